"""Programmatic dependent launch (kernels/pdl.py) on a CPU machine: when it is active, and the contract in the
code a kernel compiles to for sm_90 (Triton's own compiler, no GPU): the GEMV issues its first weight load before
`griddepcontrol.wait`, and touches the activations only after it. Equality of results with PDL on and off is
a GPU test (tests/models/test_gpu_models.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import launch_config, pdl

# Compiled in a child: this test session runs Triton's interpreter (tests/conftest.py), whose kernels cannot
# be compiled. It prints, for USE_PDL off and on, the PTX line numbers of the global loads and the
# griddepcontrol instructions.
_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.kernels.gemv import _gemv_kernel

ints = ("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om", "stride_osplit")
signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32",
             "counter_ptr": "*i32", **dict.fromkeys(ints, "i32")}
found = {}
for use_pdl in (False, True):
    constants = {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 1024, "SPLIT_K": 1, "HAS_BIAS": False, "EVEN_K": True,
                 "GATED": False, "USE_PDL": use_pdl}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 8, 9, 10, 11)}  # as at launch: 16B loads
    source = ASTSource(
        _gemv_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants, attrs=aligned
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    lines = ptx.splitlines()
    found[str(use_pdl)] = {key: [i for i, line in enumerate(lines) if key in line]
                           for key in ("ld.global", "griddepcontrol.wait", "griddepcontrol.launch_dependents")}
print(json.dumps(found))
"""


@pytest.fixture
def pdl_on() -> Iterator[None]:
    before = launch_config.pdl_enabled()
    launch_config.set_pdl(True)
    yield
    launch_config.set_pdl(before)


def test_pdl_is_for_cuda_launches_only(pdl_on: None) -> None:
    assert not pdl.active(torch.device("cpu"))  # the interpreter never launches with it
    assert pdl.launch(torch.device("cpu")) == {"USE_PDL": False}  # no launch_pdl keyword for the interpreter
    assert pdl.launch_options(True) == {"USE_PDL": True, "launch_pdl": True}  # the wait goes with the launch
    launch_config.set_pdl(False)
    assert not pdl.active(torch.device("cuda", 0))  # off: no device query at all
    assert pdl.launch(torch.device("cuda", 0)) == {"USE_PDL": False}


def test_the_gemv_streams_its_first_weights_before_it_waits() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    plain, chained = found["False"], found["True"]
    assert not plain["griddepcontrol.wait"] and not plain["griddepcontrol.launch_dependents"]
    (wait,), (launch,) = chained["griddepcontrol.wait"], chained["griddepcontrol.launch_dependents"]
    assert wait < launch
    loads = chained["ld.global"]
    assert len([i for i in loads if i < wait]) == 1  # the first weight tile; the activations only after the wait
    assert any(i > wait for i in loads)
