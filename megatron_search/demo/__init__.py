"""The embedded CPU demo (`megatron-search demo`): the stages as subcommands (pipeline.py) and its report
(report.py). The top floor beside cli/: it drives every stage, so nothing below may import it."""
