"""``deterministic``: runs that repeat bit for bit (Megatron's ``--deterministic-mode``, as
Megatron-Bridge sets it up).

    [plugins.deterministic]
    warn_only = false     # true: a nondeterministic op warns instead of raising

From ``configure_run`` (before the model, the data and any collective exist) it turns on
``torch.use_deterministic_algorithms`` (an op with no deterministic kernel raises, naming
itself), cuDNN's deterministic kernels without autotuning, and sets the environment the
libraries read when they first start: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS),
``NCCL_ALGO`` (one fixed all-reduce algorithm; Megatron requires one of Ring, Tree,
CollnetDirect, CollnetChain, ^NVLS; kept when the launcher set it) and
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (Transformer Engine). DataLoader workers are seeded from
the run already (each loader's generator is fixed by run seed and rank), so runs with workers
repeat too. It costs speed on a GPU; on a CPU the kernels are deterministic anyway. What was
turned on or set is put back when the run is let go, however far it got (``close_run``: also
after a failed build), so a notebook's next run starts as it was.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from attrs import define, field

from coretrain import FieldValueError, Run, UserError, hookimpl

log = logging.getLogger("coretrain")

NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "^NVLS")
"""The all-reduce algorithms Megatron's deterministic mode accepts."""


def _nccl_algo(instance: Any, attribute: Any, value: str) -> None:
    if value not in NCCL_ALGOS:
        raise FieldValueError(attribute.name, f"expected one of {', '.join(NCCL_ALGOS)}; got {value!r}")


@define(kw_only=True)
class Deterministic:
    """torch's deterministic algorithms, cuDNN's deterministic kernels, a fixed NCCL algorithm."""

    warn_only: bool = False
    """Warn on an op without a deterministic implementation instead of raising."""
    nccl_algo: str = field(default="Ring", validator=_nccl_algo)
    """NCCL_ALGO when the environment does not set it already."""
    _before: tuple[bool, bool, bool, bool] | None = field(default=None, init=False, repr=False)
    _environ: dict[str, str | None] = field(factory=dict, init=False, repr=False)

    @hookimpl(tryfirst=True)  # before any plugin builds or runs a kernel
    def configure_run(self, run: Run) -> None:
        algo = os.environ.get("NCCL_ALGO", self.nccl_algo)
        if algo not in NCCL_ALGOS:
            raise UserError(
                f"plugins.deterministic: the environment sets NCCL_ALGO={algo!r}, which lets NCCL choose its "
                f"reduction order; unset it, or set one of {', '.join(NCCL_ALGOS)}"
            )
        wanted = {"NCCL_ALGO": algo, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
        wanted["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # :16:8 works too
        for name, value in wanted.items():
            self._environ[name] = os.environ.get(name)
            os.environ[name] = value
        cudnn = torch.backends.cudnn
        self._before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn.deterministic,
            cudnn.benchmark,
        )
        torch.use_deterministic_algorithms(True, warn_only=self.warn_only)
        cudnn.deterministic, cudnn.benchmark = True, False
        if run.dist.is_main:
            log.info("deterministic: torch's deterministic algorithms on, NCCL_ALGO=%s", algo)

    @hookimpl
    def close_run(self) -> None:
        """Put back what configure_run set: also after a build that failed (a refused resume, a
        provider's error), so a notebook's next run is not silently deterministic."""
        if self._before is not None:
            enabled, warn_only, deterministic, benchmark = self._before
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark
            self._before = None
        for name, value in self._environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._environ.clear()
