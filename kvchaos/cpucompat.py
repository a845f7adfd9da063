"""CPU compatibility layer for real SGLang prefill/decode on a machine without a GPU.

Loaded into every SGLang process (and the harness's own) by ``kvchaos/_boot/sitecustomize.py``
when ``KVCHAOS_CPU_COMPAT=1``. It changes nothing on disk: every patch is applied at import time,
only to the module that needs it, and only where the measured incompatibility exists
(``docs/engine/sglang-on-cpu.md``). The GPU profile never loads it.

It is pinned to the versions it was written for. On any other version it refuses to run with a
message naming the package, the version found and the version expected — silently patching code
we have not read would be worse than not starting.

Patches (each is a no-op when its precondition is absent):

1. ``torchvision._meta_registrations`` — PyPI's torchvision 0.28.0 is a CUDA build whose compiled
   ops are missing beside the CPU torch; the module registers fakes for ``torchvision::nms`` and
   ``torchvision::qnms`` unconditionally and import fails with
   ``operator torchvision::nms does not exist``. The source is rewritten at load time so those two
   registrations run only when ``torchvision.extension._has_ops()``, like every other one there.
2. ``vllm._custom_ops`` — ``sglang.srt.layers.rotary_embedding.base`` imports
   ``rotary_embedding`` from it in ``__init__`` on platforms it does not recognise; only
   ``forward_cuda`` would call it. A stand-in module is provided when vllm is not installed; calling
   the function raises.
3. ``sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices`` is set
   False: with True, ``prefill.py`` allocates ``pin_memory=True`` tensors and a ``torch.cuda.Event``
   on every KV chunk send, which fails without CUDA. False takes the existing
   ``kv_to_page_indices`` path.
4. ``sglang.srt.disaggregation.nixl.conn`` — NIXL labels the KV pool ``VRAM`` whatever the device;
   UCX then rejects it. Memory kinds are mapped VRAM→DRAM.
5. ``sglang.srt.models.deepseek_common.attention_backend_handler`` — MLA models (DeepSeek-V2/V3
   family: ``MLATokenToKVPool``) have no attention handler for ``torch_native``; the registry falls
   back to the triton handler, which sends prefills without a cached prefix down the plain MHA path
   (``forward_mha``, ``save_kv_cache=False``) and torch_native then attends over the latent buffer:
   warmup dies with ``Expected size for first two dimensions of batch2 tensor to be: [4, 48] but
   got: [4, 80]``. A ``torch_native`` handler is registered that sends every pass down the absorbed
   MLA path (``_dispatch_mla_subtype`` → ``forward_mla``: ``torch.bmm`` + ``set_kv_buffer``), the
   path decode always takes, so the latent KV is written and read through the real MLA pool.
6. ``sglang.srt.mem_cache.allocator.paged`` — paged layouts (``--page-size`` > 1) on 0.5.19-0.5.21:
   ``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` launch the Triton kernels
   ``alloc_extend_kernel`` / ``alloc_decode_kernel`` unconditionally and the first paged allocation
   (prefill's extend, decode's pre-allocation) dies with ``0 active drivers ([]). There should only
   be one.`` 0.5.22 and 0.5.23 gate them on ``current_platform.capabilities.supports_triton`` and take
   ``alloc_extend_naive`` / ``alloc_decode_naive`` on CPU. Where the module has no
   ``alloc_decode_naive`` (the gate's absence) and torch has no CUDA, the two kernel names in the
   module are replaced by launchers with the kernels' call shape (``kernel[grid](*args)``) that run
   torch instead: extend runs the release's own ``alloc_extend_naive`` (present, unused, in
   0.5.19-0.5.21); decode runs ``alloc_decode_naive``'s semantics as 0.5.22 ships them (a request
   whose new token opens a page gets the first slot of the next free page, in batch order; the
   others continue at ``last_loc + 1``). Where the pool is short of the pages the batch needs, the
   launchers write nothing: the unpatched method then finds the shortfall and returns None, as after
   the Triton kernel's out-of-bounds read. The allocator methods themselves are untouched (the fault
   agent hooks those).
7. ``sglang.srt.managers.scheduler.Scheduler.on_idle`` — a PD scheduler with work parked and no batch
   to run (prefill waiting on its KV transfers, decode on pre-allocation or a transfer) does not
   sleep even with ``--sleep-on-idle``: 0.5.22/0.5.23 loop through ``time.sleep(0)``, 0.5.19 spins
   outright. A GPU host gives every scheduler a core of its own; this machine has two cores, and
   py-spy found prefill spending 44 % of the clean control there while decode, the step that
   actually runs, waited for the CPU. With ``KVCHAOS_PARKED_POLL_MS=<ms>`` (the CPU profile sets
   it), after each such pass the scheduler waits up to that long on the sockets ``--sleep-on-idle``
   already polls, so a request arriving wakes it at once; a transfer finishing is seen at the next
   poll, at most that late. A fully idle pass (already asleep in ``IdleSleeper``) and a scheduler
   without an idle sleeper are left as they are. Unset or 0: not applied.
8. ``sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.
   batch_transfer_sync`` — Mooncake's ``batchTransferSync`` (transfer_engine_py.cpp) submits the batch
   and then loops on ``getBatchTransferStatus`` with no sleep or yield until the write completes: a
   thread spinning on one of this machine's two cores while the TCP transport's own threads, and decode,
   do the work it waits for (py-spy: 37 % of prefill's samples in ``make test``). With
   ``KVCHAOS_TRANSFER_WAIT_NICE=<n>`` (opt-in; the CPU profile leaves it unset, see its comment) each thread that calls it is set to nice
   ``n`` before its first call (Linux niceness is per thread), so the spin gets the CPU others leave
   idle. Mooncake's code, its transfer and its result are untouched; only the calling thread's
   priority changes. Unset or 0: not applied.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import types

# package -> exact versions this layer was written and tested against
PINNED = {
    # 0.5.19: the pre-fix release used by the GLM-5.3 incident reproduction (scripts/setup-engine.sh);
    # 0.5.20-0.5.22: the releases between (same script). Read for these patches in each: rotary
    # base imports vllm the same way, nixl conn labels VRAM the same way, and their Mooncake sender
    # has no supports_host_tensor_indices (new in 0.5.23: patch 3 is a no-op there).
    "sglang": ("0.5.23", "0.5.22", "0.5.21", "0.5.20", "0.5.19"),
    "torch": ("2.13.0+cpu", "2.13.0"),
    "torchvision": ("0.28.0",),
    "sglang-router": ("0.3.2",),
}

APPLIED: list[str] = []


class CompatVersionError(RuntimeError):
    pass


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions(pinned: dict = PINNED) -> None:
    """Raise CompatVersionError naming every package whose version differs from the pin."""
    bad = []
    for name, allowed in pinned.items():
        found = _dist_version(name)
        if found is None:
            continue  # not installed in this interpreter (e.g. router-only env); nothing to patch
        if found not in allowed:
            bad.append(f"{name}=={found} (kvchaos.cpucompat was written for {' or '.join(allowed)})")
    if bad:
        raise CompatVersionError(
            "kvchaos CPU compatibility layer refuses to patch unverified versions: "
            + "; ".join(bad)
            + ". Rebuild the environment with `make setup` or unset KVCHAOS_CPU_COMPAT for a GPU profile."
        )


# ---------------------------------------------------------------- source-rewriting loader
class _RewritingLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, rewrite):
        super().__init__(fullname, path)
        self._rewrite = rewrite

    def get_code(self, fullname):
        src = self.get_data(self.path).decode("utf-8")
        return compile(self._rewrite(src), self.path, "exec", dont_inherit=True)


def _rewrite_tv_meta(src: str) -> str:
    guard = "(torch.library.register_fake({op}) if torchvision.extension._has_ops() else (lambda f: f))"
    out = src
    for op in ('"torchvision::nms"', '"torchvision::qnms"'):
        needle = f"@torch.library.register_fake({op})"
        if needle in out:
            out = out.replace(needle, "@" + guard.format(op=op))
    if out != src:
        APPLIED.append("torchvision-meta-guard")
    return out


class _VllmStandIn(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "vllm":
            module.__path__ = []
            module.__kvchaos_stand_in__ = True
        else:
            def rotary_embedding(*a, **k):  # noqa: ARG001
                raise RuntimeError(
                    "vllm._custom_ops.rotary_embedding is a kvchaos CPU stand-in; "
                    "it is only reachable from forward_cuda, which must not run on CPU"
                )

            module.rotary_embedding = rotary_embedding
        APPLIED.append(f"stand-in:{module.__name__}")


def _patch_mooncake_conn(mod) -> None:
    cls = getattr(mod, "MooncakeKVSender", None)
    if cls is not None and getattr(cls, "supports_host_tensor_indices", False):
        cls.supports_host_tensor_indices = False
        APPLIED.append("mooncake-no-host-tensor-indices")


def _patch_nixl_conn(mod) -> None:
    # strided (Nx5) descriptor lists are not found for host memory by the UCX plugin
    # (NIXL_ERR_NOT_FOUND in prep_xfer_dlist): use sglang's own per-block fallback
    for name in dir(mod):
        cls = getattr(mod, name)
        if isinstance(cls, type) and cls.__dict__.get("_use_strided_descs") is True:
            cls._use_strided_descs = False
            APPLIED.append(f"nixl-per-block-descs:{name}")
    # NIXL's python API takes mem type strings; sglang passes "VRAM" for the KV pool regardless
    # of device. Wrap every callable in the module's agent that registers memory.
    try:
        import nixl._api as nixl_api  # type: ignore
    except Exception:  # nixl not installed: nothing to patch
        return
    agent_cls = getattr(nixl_api, "nixl_agent", None)
    if agent_cls is None or getattr(agent_cls, "_kvchaos_dram", False):
        return
    # every public method that can carry a memory kind (register/deregister/query memory, reg and
    # xfer descriptor lists, prep_xfer_dlist, ...): a "VRAM" argument becomes "DRAM"
    for meth in [m for m in vars(agent_cls) if not m.startswith("_") and callable(getattr(agent_cls, m))]:
        orig = getattr(agent_cls, meth, None)
        if orig is None:
            continue

        def wrapped(self, *args, __orig=orig, **kwargs):
            args = tuple("DRAM" if isinstance(a, str) and a == "VRAM" else a for a in args)
            for k in ("mem_type", "mem_kind"):
                if kwargs.get(k) == "VRAM":
                    kwargs[k] = "DRAM"
            return __orig(self, *args, **kwargs)

        setattr(agent_cls, meth, wrapped)
    agent_cls._kvchaos_dram = True
    APPLIED.append("nixl-vram-as-dram")


def _patch_mla_handler(mod) -> None:
    reg = getattr(mod, "AttentionBackendRegistry", None)
    dispatch = getattr(mod, "_dispatch_mla_subtype", None)
    if reg is None or dispatch is None or "torch_native" in getattr(reg, "_handlers", {}):
        return  # a release that has its own torch_native handler needs nothing

    def handle_attention_torch_native(attn, forward_batch):
        return dispatch(attn, forward_batch)

    reg.register("torch_native", handle_attention_torch_native)
    APPLIED.append("mla-torch-native-absorbed")


class _TorchLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` calls ``fn(*args)``."""

    def __init__(self, fn, kernel):
        self.fn, self.kernel = fn, kernel  # the Triton kernel it replaces, kept for reference
        self.__name__ = getattr(kernel, "__name__", fn.__name__)

    def __getitem__(self, grid):
        return self.fn


def _new_pages(prefix_lens, seq_lens, page_size):
    return (seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size


def _alloc_decode_torch(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    """``alloc_decode_kernel`` in torch (as 0.5.22's ``alloc_decode_naive``): one new token per
    request; request i opens a page iff ``(seq_lens[i] - 1) % page_size == 0`` and then gets
    ``free_pages[k] * page_size``, k = how many requests before it opened one."""
    import torch

    del bs_upper  # a Triton block size
    need = ((seq_lens - 1) % page_size == 0).to(torch.int64)
    total = int(need.sum())
    if total == 0:
        out_indices.copy_(last_loc + 1)
        return
    if total > free_pages.numel():
        return  # the caller sees the short pool and returns None
    rank = (torch.cumsum(need, 0) - need).clamp_(max=total - 1)
    out_indices.copy_(torch.where(need.bool(), free_pages[rank] * page_size, last_loc + 1))


def _patch_paged_allocator(mod) -> None:
    naive = getattr(mod, "alloc_extend_naive", None)
    if (hasattr(mod, "alloc_decode_naive") or naive is None
            or not hasattr(mod, "alloc_extend_kernel") or not hasattr(mod, "alloc_decode_kernel")
            or isinstance(mod.alloc_extend_kernel, _TorchLaunch)):
        return  # a release with its own non-Triton path (0.5.22+), or one this was not read for
    import torch

    if torch.cuda.is_available():
        return  # Triton has a driver here

    def alloc_extend_torch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        del bs_upper  # a Triton block size
        if int(_new_pages(prefix_lens, seq_lens, page_size).sum()) > free_pages.numel():
            return  # the caller sees the short pool and returns None
        naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)

    mod.alloc_extend_kernel = _TorchLaunch(alloc_extend_torch, mod.alloc_extend_kernel)
    mod.alloc_decode_kernel = _TorchLaunch(_alloc_decode_torch, mod.alloc_decode_kernel)
    APPLIED.append("paged-alloc-torch")


def _env_int(name: str, lo: int, hi: int, what: str) -> int:
    """Environment variable ``name`` as a whole number in lo..hi (unset or empty: 0); anything else stops
    the process with a message naming the variable, its value and ``what`` it must be."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = lo - 1
    if not lo <= n <= hi:
        raise CompatVersionError(f"{name}={raw!r} is not {what} in {lo}..{hi}")
    return n


def parked_poll_ms() -> int:
    """``KVCHAOS_PARKED_POLL_MS`` as a whole number of milliseconds (0: patch 7 not applied)."""
    return _env_int("KVCHAOS_PARKED_POLL_MS", 0, 1000, "a whole number of milliseconds")


def _patch_scheduler(mod) -> None:
    ms = parked_poll_ms()
    cls = getattr(mod, "Scheduler", None)
    orig = getattr(cls, "on_idle", None)
    if not ms or orig is None or not hasattr(cls, "is_fully_idle") or getattr(orig, "_kvchaos_parked_poll", 0):
        return

    def on_idle(self):
        orig(self)
        sleeper = getattr(self, "idle_sleeper", None)
        if sleeper is None or self.is_fully_idle():
            return
        poller, ring = getattr(sleeper, "poller", None), getattr(sleeper, "rust_server", None)
        if poller is not None:
            poller.poll(ms)  # returns at once when a request is waiting on the tokenizer/rpc sockets
        elif ring is not None:  # the embedded Rust server's sleeper parks on its request ring instead
            ring.wait_request(ms)
        else:
            time.sleep(ms / 1000)

    on_idle.__wrapped__ = orig
    on_idle._kvchaos_parked_poll = ms
    cls.on_idle = on_idle
    APPLIED.append(f"scheduler-parked-poll-{ms}ms")


def transfer_wait_nice() -> int:
    """``KVCHAOS_TRANSFER_WAIT_NICE`` as a niceness in 0..19 (0: patch 8 not applied)."""
    return _env_int("KVCHAOS_TRANSFER_WAIT_NICE", 0, 19, "a niceness")


def _patch_mooncake_engine(mod) -> None:
    n = transfer_wait_nice()
    cls = getattr(mod, "MooncakeTransferEngine", None)
    orig = getattr(cls, "batch_transfer_sync", None)
    if not n or orig is None or getattr(orig, "_kvchaos_nice", 0):
        return
    niced = threading.local()

    def batch_transfer_sync(self, *args, **kwargs):
        if not getattr(niced, "done", False):
            niced.done = True
            try:  # this thread only; a later call in it finds it done
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), n)
            except OSError:
                pass  # a priority refused changes timing, never the transfer
        return orig(self, *args, **kwargs)

    batch_transfer_sync.__wrapped__ = orig
    batch_transfer_sync._kvchaos_nice = n
    cls.batch_transfer_sync = batch_transfer_sync
    APPLIED.append(f"mooncake-transfer-wait-nice-{n}")


POST_IMPORT = {
    "sglang.srt.managers.scheduler": _patch_scheduler,
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine": _patch_mooncake_engine,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_handler,
    "sglang.srt.mem_cache.allocator.paged": _patch_paged_allocator,
    "sglang.srt.disaggregation.mooncake.conn": _patch_mooncake_conn,
    "sglang.srt.disaggregation.nixl.conn": _patch_nixl_conn,
}
REWRITE = {"torchvision._meta_registrations": _rewrite_tv_meta}


class PostImportLoader(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self._inner, self._hook = inner, hook

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._hook(module)


class CompatFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that routes the few modules we patch through our loaders."""

    def __init__(self):
        self._vllm_missing = None

    def find_spec(self, fullname, path, target=None):
        if fullname in REWRITE or fullname in POST_IMPORT:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
                return spec
            if fullname in REWRITE:
                spec.loader = _RewritingLoader(fullname, spec.origin, REWRITE[fullname])
            else:
                spec.loader = PostImportLoader(spec.loader, POST_IMPORT[fullname])
            return spec
        if fullname in ("vllm", "vllm._custom_ops"):
            if self._vllm_missing is None:
                self._vllm_missing = importlib.machinery.PathFinder.find_spec("vllm") is None
            if self._vllm_missing:
                return importlib.util.spec_from_loader(fullname, _VllmStandIn(), is_package=fullname == "vllm")
        return None


_INSTALLED = False


def install(check: bool = True) -> None:
    """Install the import hooks (idempotent). Call before sglang/torchvision are imported."""
    global _INSTALLED
    if _INSTALLED:
        return
    if check:
        check_versions()
    parked_poll_ms()  # a bad value stops this process now, not at the scheduler's import
    transfer_wait_nice()
    for name in list(REWRITE) + list(POST_IMPORT):
        if name in sys.modules:  # imported before us: apply post-import patches directly
            hook = POST_IMPORT.get(name)
            if hook:
                hook(sys.modules[name])
    sys.meta_path.insert(0, CompatFinder())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _INSTALLED = True


def enabled() -> bool:
    return os.environ.get("KVCHAOS_CPU_COMPAT", "") == "1"


def describe() -> types.SimpleNamespace:
    return types.SimpleNamespace(installed=_INSTALLED, applied=list(APPLIED), pinned=PINNED)
