"""The op-level memory table (``--memory-table``): ColPali in-batch training on CUDA.

For each batch size B (Nq = Nd = B, Lq = 128, Ld = 1024, bf16) and each provider, the memory
held from the forward to the backward and the backward's spike above it, from the allocator's
statistics; fused providers run one step first so one-time autotune buffers stay out of it.
"""

from __future__ import annotations

import torch

from .providers import provider_unavailable
from .records import environment
from .shapes import Case, Shape, make_case
from .util import Progress, describe_error, json_safe, release_memory

# Op-level memory of ColPali in-batch training: Nq = Nd = B, Lq = 128, Ld = 1024, bf16.
MEMORY_BATCHES = (16, 32, 64, 128, 256)
MEMORY_PROVIDERS = ("naive", "lik", "flash", "fusedmaxsim")


def memory_step(score, case: Case, warm: bool) -> tuple:
    """Memory held from forward to backward, and the backward's spike above it, in MiB.

    ``warm`` runs one step first so one-time allocations (autotune buffers) stay out of it.
    """
    device = case.Q.device
    if warm:
        score().backward(case.grad_out)
        case.reset_grads()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    out = score()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out.backward(case.grad_out)
    torch.cuda.synchronize(device)
    spike = torch.cuda.max_memory_allocated(device) - before
    del out
    case.reset_grads()
    return held / 2**20, spike / 2**20


def run_memory_table(providers, device, batches=MEMORY_BATCHES, progress=None,
                     on_update=None) -> dict:
    """ColPali in-batch training (Nq = Nd = B, Lq = 128, Ld = 1024, bf16) for each batch B.

    ``on_update(section)`` is called after each row, so a run cut short keeps its rows.
    """
    device = torch.device(device)
    section = {"env": environment(device), "lq": 128, "ld": 1024, "dtype": "bfloat16",
               "batches": list(batches), "rows": []}
    if device.type != "cuda":
        section["skipped"] = "needs CUDA (allocator statistics)"
        return section
    progress = progress or Progress(len(batches) * len(providers), enabled=False)
    unavailable = {p.key: provider_unavailable(p, device) for p in providers}
    for batch in batches:
        shape = Shape(f"colpali_inbatch_{batch}", "cross", batch, batch, 128, 1024, "training")
        case = make_case(shape, "training", device)
        for provider in providers:
            progress.start(f"memory B={batch} {provider.key}")
            row = {"batch": batch, "provider": provider.key, "status": None, "error": None,
                   "held_mib": None, "spike_mib": None, "total_mib": None}
            if unavailable[provider.key]:
                row.update(status="skipped", error=unavailable[provider.key])
            else:
                try:
                    held, spike = memory_step(provider.build(case), case,
                                              warm=provider.role != "baseline")
                    row.update(status="ok", held_mib=held, spike_mib=spike,
                               total_mib=held + spike)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: record it
                    row.update(status="failed", error=describe_error(exc))
                    case.reset_grads()
            section["rows"].append(json_safe(row))
            progress.done(row["status"] if row["status"] != "ok"
                          else f"{row['total_mib']:.0f} MiB")
            release_memory(device)
            if on_update is not None:
                on_update(section)
        case = None
        release_memory(device)
    progress.close()
    return section
