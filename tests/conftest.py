import os

# Keep CPU tests deterministic and light on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Hugging Face `datasets` keeps its Arrow copies of the files tests read in a throw-away cache, not ~/.cache.
if "HF_DATASETS_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="megatron-search-hf-cache-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)
