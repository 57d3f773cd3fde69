"""Every Triton kernel compiles for a real GPU target (sm_90: TTIR -> PTX -> cubin) on this GPU-less machine.

The interpreter tests check what the kernels compute; this checks what only the compiler sees:
loop-carried types, constexpr branches, pointer dtypes (bf16/fp32 logits, bool mask, int64 ids).
"""
import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from megatron_search.kernels import group_advantage_triton as G
from megatron_search.kernels import logprob_triton as L

TARGET = GPUTarget("cuda", 90, 32)
F32 = "*fp32"

STATS_SIG = {"stride_xr": "i64", "stride_xc": "i64", "n_cols": "i32", "tgt_ptr": "*i64", "vocab_offset": "i64",
             "m_ptr": F32, "s_ptr": F32, "w_ptr": F32, "xt_ptr": F32, "HAS_W": "constexpr", "BLOCK": "constexpr"}
GRAD_SIG = {"stride_xr": "i64", "stride_xc": "i64", "stride_or": "i64", "stride_oc": "i64", "n_cols": "i32",
            "tgt_ptr": "*i64", "vocab_offset": "i64", "lse_ptr": F32, "ent_ptr": F32, "glogp_ptr": F32, "gent_ptr": F32,
            "HAS_ENT": "constexpr", "BLOCK": "constexpr"}
FINAL_SIG = {"m_ptr": F32, "s_ptr": F32, "w_ptr": F32, "xt_ptr": F32, "li_ptr": F32, "mask_ptr": "*i1", "lse_ptr": F32,
             "logp_ptr": F32, "ent_ptr": F32, "ratio_ptr": F32, "dratio_ptr": F32, "n": "i32",
             "HAS_W": "constexpr", "HAS_INFER": "constexpr", "HAS_MASK": "constexpr", "BLOCK": "constexpr"}
ADV_SIG = {"r_ptr": F32, "goff_ptr": "*i64", "toff_ptr": "*i64", "adv_ptr": F32, "tok_ptr": F32, "eps": "fp32",
           "STD": "constexpr", "UNBIASED": "constexpr", "HAS_TOK": "constexpr", "BLOCK": "constexpr", "TOK_BLOCK": "constexpr"}


def _compile(kernel, signature, constexprs):
    fn = JITFunction(kernel.fn)  # a compilable function even if TRITON_INTERPRET was set when L/G were imported
    ordered = {name: signature[name] for name in fn.arg_names}  # KeyError here = signature out of date
    compiled = triton.compile(ASTSource(fn=fn, signature=ordered, constexprs=constexprs), target=TARGET)
    assert len(compiled.asm["cubin"]) > 0 and ".entry" in compiled.asm["ptx"]


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_logprob_kernels_compile_for_sm90(dtype):
    for has_w in (True, False):
        _compile(L._online_stats_kernel, {"x_ptr": dtype, **STATS_SIG}, {"HAS_W": has_w, "BLOCK": L.TRITON_BLOCK_COLS})
    for has_ent in (True, False):
        _compile(L._write_grad_kernel, {"x_ptr": dtype, "out_ptr": dtype, **GRAD_SIG},
                 {"HAS_ENT": has_ent, "BLOCK": L.TRITON_BLOCK_COLS})


def test_finalize_and_group_advantage_kernels_compile_for_sm90():
    for flags in ((True, True, True), (False, True, False), (False, False, False)):
        _compile(L._finalize_kernel, FINAL_SIG,
                 dict(zip(("HAS_W", "HAS_INFER", "HAS_MASK"), flags), BLOCK=L.FINALIZE_BLOCK))
    for std, unbiased, has_tok in ((True, True, True), (False, False, False)):
        _compile(G._group_adv_kernel, ADV_SIG, {"STD": std, "UNBIASED": unbiased, "HAS_TOK": has_tok,
                                                "BLOCK": G.ROLLOUT_BLOCK, "TOK_BLOCK": G.TOKEN_BLOCK})
