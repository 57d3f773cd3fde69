#!/usr/bin/env python
"""Peak extra memory and time of token logprob forward + backward: naive torch vs the fused kernels.

    python tools/bench_logprob.py                       # T=4096, V in {151936, 248320}, H=2048, bf16
    python tools/bench_logprob.py --vocab 32000 --tokens 1024 --cases naive,fused_inplace

Cases (each runs in its own subprocess, so its peak RSS is its own):
  naive            log_softmax(logits.float()).gather(targets), backward (what a plain loss does)
  fused            kernels.token_logprobs, torch reference path, gradient into a fresh bf16 buffer
  fused_inplace    same, inplace_backward=True (gradient written into the logits' storage)
  fused_is_ent     fused_inplace plus IS ratio (with logp_infer and mask) and entropy
  naive_linear     hidden @ weight.T, then naive; backward to hidden and weight
  fused_linear     kernels.linear_token_logprobs from hidden [T, H] and weight [V, H]
Peak extra memory = peak RSS during the runs minus the RSS once the inputs exist: the kernel's
peak-RSS counter (VmHWM) is reset after the inputs are created by writing 5 to
/proc/self/clear_refs (where that is refused, getrusage's peak since start is used; inputs are
filled in place with normal_, so creating them leaves no larger peak behind). Time = best of
--repeats forward + backward runs (inputs refilled between runs, outside the timing), as process
CPU time (the ratio column; summed over threads) and wall time: with one thread, CPU time measures this process's work
even when other jobs load the machine, wall time also measures the neighbours. Each fused
case's logp is compared with the naive case's logp of the same run (max |diff|).
Default one torch thread: on a shared 2-core machine intra-op threads wait on each other at every
op (seen: the tiled torch path 10x slower with 2 threads under load, not with 1).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CASES = ("naive", "fused", "fused_inplace", "fused_is_ent", "naive_linear", "fused_linear")
FILL_ROWS = 64  # rows per normal_ call when filling inputs (progress granularity only)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS; False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset_ok: bool) -> int:
    if reset_ok:
        return _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _fill(t, seed: int, scale: float) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for r0 in range(0, t.shape[0], FILL_ROWS):
        t[r0 : r0 + FILL_ROWS].normal_(0.0, scale, generator=g)


def run_case(case: str, tokens: int, vocab: int, hidden: int, repeats: int, threads: int, logp_path: str) -> dict:
    import torch

    from megatron_search.kernels import linear_token_logprobs, token_logprobs

    torch.set_num_threads(threads)
    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    weights = torch.randn(tokens, generator=g)
    logp_infer = -torch.rand(tokens, generator=g) * 8
    mask = torch.rand(tokens, generator=g) > 0.2
    linear = case.endswith("linear")
    if linear:
        h = torch.empty(tokens, hidden, dtype=bf16)
        w = torch.empty(vocab, hidden, dtype=bf16)
        _fill(h, 2, 1.0)
        _fill(w, 3, 3.0 / hidden**0.5)
        h.requires_grad_()
        w.requires_grad_()
    else:
        logits = torch.empty(tokens, vocab, dtype=bf16)
        _fill(logits, 2, 3.0)
    reset_ok = _reset_peak()
    baseline = _status_bytes("VmRSS") if reset_ok else _peak_rss_bytes(False)
    best = best_cpu = float("inf")
    for rep in range(repeats):
        if not linear and rep:
            logits.grad = None
            logits.requires_grad_(False)
            _fill(logits, 2, 3.0)  # the in-place case overwrote them
        if linear:
            h.grad = w.grad = None
        else:
            logits.requires_grad_()
        t0, c0 = time.perf_counter(), time.process_time()
        extra = 0.0  # further loss terms (the IS-ratio + entropy case)
        if case == "naive":
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        elif case == "naive_linear":
            logp = torch.log_softmax((h @ w.T).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        elif case == "fused":
            logp = token_logprobs(logits, targets, backend="torch").logp
        elif case == "fused_inplace":
            logp = token_logprobs(logits, targets, inplace_backward=True, backend="torch").logp
        elif case == "fused_is_ent":
            out = token_logprobs(logits, targets, logp_infer=logp_infer, mask=mask, with_entropy=True,
                                 inplace_backward=True, backend="torch")
            logp, extra = out.logp, ((out.ratio + out.entropy) * weights).sum()
        elif case == "fused_linear":
            logp = linear_token_logprobs(h, w, targets, backend="torch").logp
        else:
            raise ValueError(f"unknown case {case!r}; choose from {CASES}")
        ((logp * weights).sum() + extra).backward()  # one backward: the in-place one consumes the logits
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
        result_logp = logp.detach().clone()
        del logp, extra
    torch.save(result_logp, logp_path)
    return {"case": case, "seconds": best, "cpu_seconds": best_cpu, "extra_bytes": _peak_rss_bytes(reset_ok) - baseline,
            "logp_max": float(result_logp.max())}


def _child(args) -> None:
    print(json.dumps(run_case(args.child, args.tokens, args.vocab_one, args.hidden, args.repeats, args.threads, args.logp_path)))


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", default="151936,248320", help="comma-separated vocabulary sizes")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the *_linear cases")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--vocab-one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--logp-path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    import torch
    from tqdm import tqdm

    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    vocabs = [int(v) for v in args.vocab.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in vocabs:
            for case in tqdm(cases, desc=f"V={vocab}"):
                path = os.path.join(tmp, f"{case}_{vocab}.pt")
                cmd = [sys.executable, __file__, "--child", case, "--tokens", str(args.tokens), "--vocab-one", str(vocab),
                       "--hidden", str(args.hidden), "--repeats", str(args.repeats), "--threads", str(args.threads),
                       "--logp-path", path]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode:
                    rows.append({"vocab": vocab, "case": case, "error": (proc.stderr.strip().splitlines() or ["?"])[-1],
                                 "available_gb": _available_bytes() / 2**30})
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row["vocab"], row["path"] = vocab, path
                rows.append(row)
            ref = {r["case"]: r for r in rows if r["vocab"] == vocab and "error" not in r}
            for r in rows:
                if r["vocab"] == vocab and "error" not in r:
                    base = ref.get("naive_linear" if r["case"].endswith("linear") else "naive")
                    if base is not None:
                        r["mem_ratio"] = r["extra_bytes"] / max(base["extra_bytes"], 1)
                        r["time_ratio"] = r["cpu_seconds"] / base["cpu_seconds"]
                        r["max_abs_diff"] = float((torch.load(r["path"]) - torch.load(base["path"])).abs().max())
    print(f"\nT={args.tokens}, bf16 logits, H={args.hidden} (linear cases), {args.threads} threads, best of {args.repeats}; "
          "ratios vs the naive (naive_linear) case of the same V in this run")
    print(f"{'V':>7} {'case':<14} {'extra peak GB':>13} {'cpu s':>7} {'wall s':>7} {'mem/naive':>9} {'cpu/naive':>9} "
          f"{'max|dlogp|':>10} {'max logp':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['vocab']:>7} {r['case']:<14} failed: {r['error']} (MemAvailable {r['available_gb']:.1f} GB)")
            continue
        fmt = lambda k, f: format(r[k], f) if k in r else "-"  # noqa: E731
        print(f"{r['vocab']:>7} {r['case']:<14} {r['extra_bytes'] / 1e9:>13.2f} {r['cpu_seconds']:>7.2f} {r['seconds']:>7.2f} "
              f"{fmt('mem_ratio', '9.3f'):>9} {fmt('time_ratio', '9.2f'):>9} {fmt('max_abs_diff', '10.2e'):>10} {r['logp_max']:>9.2e}")


if __name__ == "__main__":
    main()
