"""Native CPU kernels: ``csrc/*.cpp``, built once per host at first use and called through ctypes.

The sources are plain C++ with OpenMP and no torch headers (the build takes about 10 s); the shared
library is cached under ``$TGI_PAGED_KERNEL_CACHE`` (default ``~/.cache/tgi-paged-backend/kernels``),
keyed by the source, the compiler, the flags and this CPU's instruction sets (``-march=native``), so a
cache carried to another CPU builds again. The directory is created ``0700``; a library is loaded from it
only while the directory and the file are owned by this user and writable by no one else (the name is
predictable: anyone who can write there could make this process run their code), else
:class:`UnsafeKernelCache` says what is wrong and the plain-torch paths serve. OpenMP: the library links
``libgomp.so.1``, which torch has already loaded (same soname), so both share one thread pool and
``torch.get_num_threads()`` threads.

:func:`native_kernels` returns the loaded :class:`NativeKernels`, or ``None`` when no compiler can build
them here (the reason logged once); callers then take their plain-torch path. ``TGI_PAGED_NATIVE_CPU=0``
turns them off. Each kernel has a torch reference and a test comparing the two
(``tests/kernels/test_cpu_native.py``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from ._checks import cdiv
from .kernel_cache import cache_dir, cpu_signature

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f"cpu_{n}.cpp" for n in ("kernels", "layer", "gemm", "prefill", "lora", "quant", "greedy"))
"""Compiled into one library; the headers they include are part of the cache key."""
HEADERS = tuple(sorted(CSRC.glob("cpu_*.h")))
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
"""Build flags; :func:`build_library`'s ``arch`` replaces ``native`` (the tests build ``x86-64-v3``: AVX2 paths).
``-ffp-contract=off``: no fused multiply-add the source does not write (the same bits on every ISA);
``-fno-trapping-math``: the compiler may compute a floating-point value a branch would skip (no code here reads FP
exception flags; each operation's value and rounding are unchanged). Without it GCC kept a branch around ``x * e`` in
SiLU and the clamp of the softmax's exp, so those loops ran scalar on AVX2 builds (SiLU was 10 % of an fp32
prefill). On AVX2 builds the softmax denominators (``omp simd`` reductions in decode and prefill attention) now sum
in 8 lanes, as AVX-512 builds already did in 16: a few ulp from the scalar order, still independent of the batch."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
"""Storage dtypes the kernels read natively; one-byte (fp8) pools go through a decode table (code 2)."""

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class UnsafeKernelCache(RuntimeError):
    """The kernel cache directory or a library in it is another user's or writable by others: not loaded."""


def _stat(path: Path) -> os.stat_result:
    return os.stat(path)


def check_private(directory: Path, library: Path | None = None) -> None:
    """Raise :class:`UnsafeKernelCache` unless ``directory`` (and ``library`` in it) are owned by this user and
    not writable by group or others: what is loaded from there runs as this process."""
    if not hasattr(os, "getuid"):  # not POSIX: no owners to compare
        return
    uid = os.getuid()
    for path in (directory, library):
        if path is None:
            continue
        st = _stat(path)
        if st.st_uid != uid:
            problem = f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
            fix = f"set TGI_PAGED_KERNEL_CACHE to a directory this user owns, or have {path} removed"
        elif st.st_mode & 0o022:
            problem = f"{path} is writable by {'group and others' if st.st_mode & 0o002 else 'its group'}"
            fix = f"run `chmod go-w {path}`, or set TGI_PAGED_KERNEL_CACHE to a directory only this user can write"
        else:
            continue
        raise UnsafeKernelCache(
            f"refusing to load native CPU kernels from the kernel cache {directory}: {problem} "
            f"(mode {oct(st.st_mode & 0o777)}), so another user could replace the library this process runs; {fix}"
        )


def _flags(arch: str) -> tuple[str, ...]:
    return tuple(f"-march={arch}" if flag == "-march=native" else flag for flag in FLAGS)


def library_path(compiler: str, arch: str = "native") -> Path:
    """Where the build of :data:`SOURCES` by ``compiler`` for this CPU (``-march=arch``) is cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    flags = _flags(arch)
    key = hashlib.sha256("\0".join([*texts, compiler, version, *flags, cpu_signature()]).encode()).hexdigest()
    return cache_dir() / f"cpu_kernels-{key[:24]}.so"


def build_library(compiler: str | None = None, arch: str = "native") -> Path:
    """Compile :data:`SOURCES` for ``-march=arch`` (or reuse the cached build) and return the shared library's path.

    Raises ``RuntimeError`` with the compiler's message when no compiler is found or the build fails, and
    :class:`UnsafeKernelCache` (before building or returning a cached build) when :func:`check_private` fails.
    """
    compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    target = library_path(compiler, arch)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies when it is created here
    check_private(target.parent)
    if target.is_file():
        check_private(target.parent, target)
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        staged = Path(tmp) / target.name
        command = [compiler, *_flags(arch), *map(str, SOURCES), "-o", str(staged)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        staged.chmod(0o755)  # not group-writable whatever the umask, or the next start would refuse it
        os.replace(staged, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


class NativeKernels:
    """The loaded library with typed entry points; methods take torch tensors and check what C cannot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))

        def bind(name: str, *argtypes: type) -> Any:
            """``name`` of the library, typed: every entry point returns an int status."""
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _int, list(argtypes)
            return fn

        self._decode = bind(
            "tgi_paged_decode_attention",
            _ptr, _i64, _i64,  # query, strides
            _ptr, _ptr, _int, _ptr,  # caches, dtype code, decode table
            _i64, _i64, _i64, _i64,  # pool blocks, cache strides
            _ptr, _int, _i64, _i64,  # block tables, int64?, row stride, width
            _ptr, _int,  # seq lens
            _ptr, _int, _int, _int, _int, _int,  # out, B, Hq, Hkv, D, block size
            _float, _float, _int, _ptr, _float, _float, _int,
            _int,  # V's width
        )  # fmt: skip
        self._rms_norm = bind("tgi_paged_rms_norm", _ptr, _i64, _ptr, _ptr, _i64, _i64, _float, _int, _int)
        self._store = bind(
            "tgi_paged_store_kv", _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64
        )
        self._rope = bind("tgi_paged_rope_neox", _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int)
        self._silu_and_mul = bind("tgi_paged_silu_and_mul", _ptr, _i64, _ptr, _i64, _i64, _int, _int)
        gemm = (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int)
        self.gemm_packed, self.gemm_packed_bf16 = (bind(f"tgi_paged_gemm_packed{s}", *gemm) for s in ("", "_bf16"))
        self.moe_experts = bind(  # x, T, H, picks, weights, top_k, E, I, weight dtype, w_gate_up, w_down, scratch...
            "tgi_paged_moe_experts", _ptr, _i64, _i64, _ptr, _ptr, _int, _int, _i64, _int, _ptr, _ptr, _ptr, _ptr, _int
        )
        self.gemm_packed_i8 = bind(  # a, lda, M, K, codes, zeros, scales, N, bias, add, ldadd, out, ldo, threads
            "tgi_paged_gemm_packed_i8", _ptr, _i64, _i64, _i64, *(_ptr,) * 3, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int
        )
        self.gemm_packed_f8 = bind("tgi_paged_gemm_packed_f8", *self.gemm_packed_i8.argtypes)  # zeros unused
        """Raw entry points of ``csrc/cpu_gemm.cpp``, ``cpu_quant.cpp`` (int8, fp8), ``cpu_layer.cpp``; ``cpu_gemm``,
        ``cpu_quant``, ``cpu_layer`` wrap them."""
        self._bf16_rounds = bind("tgi_paged_gemm_bf16_rounds_activations")
        self.gemm_bf16_amx = bind("tgi_paged_gemm_bf16_amx", _int)
        self.gemm_bf16_dot = bind("tgi_paged_gemm_bf16_dot", _int)
        self.decode_layer = bind(
            "tgi_paged_decode_layer",
            _ptr, _ptr, _i64, _ptr, _ptr,  # layer spec, hidden, T, cos, sin
            _ptr, _ptr, _i64, _i64, _i64, _i64,  # pools, blocks, strides
            _ptr, _ptr, _int, _i64, _i64, _ptr, _int,  # slots, tables, seq lens
            _int, _ptr, _int,  # block size, scratch, threads
            _ptr, _i64, _ptr,  # query_start_loc and requests (verify steps), LoRA (cpu_layer_lora.LayerLora)
            _int, _int,  # act dtype, KV dtype (0 fp32, 1 bf16)
        )  # fmt: skip
        # stage, partial sums (a tensor-parallel rank's parts; 0, null: the whole layer), decode_layer's arguments
        self.decode_layer_stage = bind("tgi_paged_decode_layer_stage", _int, _ptr, *self.decode_layer.argtypes)
        self.decode_layers = bind(  # a stack's decode step: per-layer specs, pools, tables; the rest shared
            "tgi_paged_decode_layers",
            _i64, _ptr, _ptr, _ptr, _ptr,  # layers, specs[], k_caches[], v_caches[], tables[]
            _ptr, _ptr,  # LoRA rows per layer (null: none), the failed layer
            _ptr, _i64, _ptr, _ptr,  # hidden, T, cos, sin
            _i64, _i64, _i64, _i64,  # blocks, pool strides
            _ptr, _ptr, _int, _i64, _i64, _ptr, _int,  # slots, slots[] (null: shared), tables' int64?, ..., seq lens
            _int, _ptr, _int,  # block size, scratch, threads
            _ptr, _i64, _int, _int,  # query_start_loc and requests (a verify step; null: decode), act, KV dtypes
        )  # fmt: skip
        self.prefill_attention = bind(
            "tgi_paged_prefill_attention",
            _ptr, _i64, _i64,  # query, strides
            _ptr, _ptr, _int, _ptr,  # caches, dtype code, decode table
            _i64, _i64, _i64, _i64,  # pool blocks, cache strides
            _ptr, _int, _i64, _i64,  # block tables, int64?, row stride, width
            _ptr, _int, _ptr, _int,  # query_start_loc, seq lens
            _ptr, _i64, _int, _int, _int, _int, _int,  # out, T, B, Hq, Hkv, D, block size
            _float, _float, _int, _ptr, _float, _float, _ptr, _int,  # ..., k/v scales, key limits, threads
        )  # fmt: skip
        """Raw entry point of ``csrc/cpu_prefill.cpp``; :mod:`tgi_paged_kernels.cpu_prefill` wraps it."""
        self.lora_add = bind(
            "tgi_paged_lora_add",
            _ptr, _i64, _ptr, _i64, _ptr,  # out, stride, x, stride, slots
            _i64, _i64, _i64, _ptr, _ptr,  # rows, in, out features, A, B stacks
            _i64, _i64, _ptr, _ptr, _int,  # slots, max rank, scales, ranks, threads
            _int, _int,  # A's and B's dtype, out's and x's (0 fp32, 1 bf16)
        )  # fmt: skip
        """Raw entry point of ``csrc/cpu_lora.cpp``; :func:`tgi_paged_kernels.lora.add_lora_cpu` wraps it."""
        self.greedy_pick = bind("tgi_paged_greedy_pick", _ptr, _i64, _i64, _i64, _ptr, _ptr, _int)
        """Raw entry point of ``csrc/cpu_greedy.cpp`` (scores, rows, vocab, row stride, ids, logprobs, threads);
        :func:`tgi_paged_kernels.cpu_greedy.greedy_pick` wraps it."""
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    @property
    def gemm_bf16_rounds_activations(self) -> bool:
        """The bf16 GEMM now rounds activations to bf16 (AMX tiles: :func:`.cpu_gemm.set_bf16_amx`, or
        ``vdpbf16ps``: :func:`.cpu_gemm.set_bf16_dot`), not widens the weights (``cpu_gemm_bf16.h``)."""
        return bool(self._bf16_rounds())

    def decode_table(self, dtype: torch.dtype) -> torch.Tensor:
        """fp32 value of each of the 256 bytes of a one-byte dtype (fp8)."""
        table = self._tables.get(dtype)
        if table is None:
            table = torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
            self._tables[dtype] = table
        return table

    def cache_dtype(self, cache: torch.Tensor) -> tuple[int, int | None]:
        """``(storage dtype code, address of its decode table or None)`` of a pool :meth:`supports_cache` takes."""
        code = DTYPE_CODES.get(cache.dtype, 2)  # else one byte per value, decoded through a table
        if code != 2:
            return code, None
        table = self.decode_table(cache.dtype)  # held by ``self._tables`` for the process: the address stays valid
        return code, table.data_ptr()

    def supports_cache(self, cache: torch.Tensor) -> bool:
        """Whether the decode kernel reads this pool (fp32, bf16 or a one-byte dtype, head_dim contiguous)."""
        return (cache.dtype in DTYPE_CODES or (cache.is_floating_point() and cache.element_size() == 1)) and (
            cache.stride(-1) == 1
        )

    def decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        softcap: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """fp32 ``[B, Hq, Dv]``, as :func:`~tgi_paged_kernels.cpu_decode.decode_attention_math` computes it.

        ``query`` ``[B, Hq, D]`` any dtype and strides (made fp32 with ``head_dim`` contiguous here);
        caches ``[num_blocks, block_size, Hkv, D]`` with K and V of one layout (strides), V ``Dv <= D`` wide
        (a latent cache's ``k_cache[..., :Dv]``, or a pool of the same strides); ``block_tables`` and
        ``seq_lens`` int32 or int64, ``block_tables`` row-contiguous.
        """
        if query.dtype != torch.float32 or query.stride(-1) != 1:
            query = query.float().contiguous()
        self._check_decode(query, k_cache, v_cache, block_tables, seq_lens, sinks)
        if block_tables.stride(-1) != 1:
            block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        num_requests, num_q_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        code, table = self.cache_dtype(k_cache)
        sinks_f32 = None if sinks is None else sinks.float().contiguous()
        v_head_dim = v_cache.shape[3]
        out = torch.empty((num_requests, num_q_heads, v_head_dim), dtype=torch.float32)
        status = self._decode(
            query.data_ptr(), query.stride(0), query.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), code, table,
            k_cache.shape[0], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.data_ptr(), int(block_tables.dtype == torch.int64), block_tables.stride(0),
            block_tables.shape[1],
            seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64),
            out.data_ptr(), num_requests, num_q_heads, num_kv_heads, head_dim, block_size,
            scale, softcap, int(sliding_window or 0), None if sinks_f32 is None else sinks_f32.data_ptr(),
            k_scale, v_scale, torch.get_num_threads(), v_head_dim,
        )  # fmt: skip
        if status != 0:
            raise ValueError(self.decode_error(status, block_tables, seq_lens, block_size, k_cache.shape[0]))
        return out

    def _check_decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> None:
        """Shapes and dtypes the C++ kernel trusts (it checks table widths and block ids itself)."""
        if (
            k_cache.stride() != v_cache.stride()
            or k_cache.dtype != v_cache.dtype
            or k_cache.shape[:3] != v_cache.shape[:3]
            or v_cache.shape[3] > k_cache.shape[3]
        ):
            raise ValueError("decode_attention: K and V pools must share dtype, layout and heads (V no wider than K)")
        if not self.supports_cache(k_cache):
            raise ValueError(f"decode_attention: no native kernel for a {k_cache.dtype} pool")
        num_requests, num_q_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        if head_dim != k_cache.shape[3] or num_q_heads % num_kv_heads:
            raise ValueError(
                f"decode_attention: query [{num_requests}, {num_q_heads}, {head_dim}] does not fit a pool of "
                f"{num_kv_heads} KV heads x {k_cache.shape[3]}"
            )
        index = (torch.int32, torch.int64)
        if block_tables.dtype not in index or seq_lens.dtype not in index:
            raise ValueError("decode_attention: block_tables and seq_lens must be int32 or int64")
        if block_tables.dim() != 2 or block_tables.shape[0] < num_requests or seq_lens.numel() < num_requests:
            raise ValueError(f"decode_attention: block_tables and seq_lens need a row per request ({num_requests})")
        if sinks is not None and sinks.numel() != num_q_heads:
            raise ValueError(f"decode_attention: sinks need one value per query head ({num_q_heads})")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``torch.rms_norm(x, weight.shape, weight, eps)`` for fp32/bf16 ``x`` and ``weight`` of one dtype
        on CPU; ``None`` when the inputs are of another kind (the caller runs torch's)."""
        # The serving path (a contiguous activation) is checked first, in as few tensor calls as possible:
        # each costs ~0.2-2 us, and a norm runs twice per layer.
        width = weight.shape[0]
        code = DTYPE_CODES.get(x.dtype)
        if code is None or weight.dtype != x.dtype or not x.is_cpu or x.shape[-1] != width:
            return None
        src = x
        if x.is_contiguous():
            rows, row_stride = x.numel() // width, width
        else:
            src = x.reshape(-1, width)  # a view when the rows are evenly strided, else a copy
            if src.stride(-1) != 1:
                return None
            rows, row_stride = src.shape[0], src.stride(0)
        if not weight.is_contiguous():
            return None
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._rms_norm(
            src.data_ptr(),
            row_stride,
            out.data_ptr(),
            weight.data_ptr(),
            rows,
            width,
            eps,
            code,
            torch.get_num_threads(),
        )
        return out

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        """Write ``key``/``value`` ``[T, Hkv, D]`` into ``slots`` of contiguous pools of their own dtype (negative
        slots skipped); ``False`` (nothing written) when the inputs are of another kind."""
        if (
            key.dtype != k_cache.dtype
            or value.dtype != key.dtype
            or v_cache.dtype != k_cache.dtype
            or key.shape != value.shape
            or key.shape[1:] != k_cache.shape[2:]
            or k_cache.shape != v_cache.shape
            or slots.numel() != key.shape[0]
            or key.stride(-1) != 1
            or value.stride(-1) != 1
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.device.type != "cpu"
        ):
            return False
        slots = slots.to(torch.int64).contiguous()
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        status = self._store(
            key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(),
            num_slots, slots.data_ptr(), key.shape[0], key.shape[1], key.shape[2], key.element_size(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"store_kv: slot_mapping holds a slot outside the pool's {num_slots} slots")
        return True

    def rope_neox(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """``x * cos + rotate_half(x) * sin`` (transformers' neox RoPE) for ``x`` ``[T, H, D]`` (head_dim
        contiguous) and ``cos``/``sin`` ``[T, D]``, as a new contiguous tensor; ``None`` for other inputs."""
        code = DTYPE_CODES.get(x.dtype)
        if (
            code is None
            or x.device.type != "cpu"
            or x.stride(-1) != 1
            or cos.dtype != x.dtype
            or sin.dtype != x.dtype
            or not (cos.is_contiguous() and sin.is_contiguous())
            or cos.shape != (x.shape[0], x.shape[2])
            or sin.shape != cos.shape
            or x.shape[2] % 2
        ):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rope(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            x.shape[0], x.shape[1], x.shape[2], code,
        )  # fmt: skip
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` for ``gate_up`` ``[..., 2 * I]`` (gate first); ``None`` for other inputs."""
        code = DTYPE_CODES.get(gate_up.dtype)
        width = gate_up.shape[-1] // 2
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        if code is None or gate_up.device.type != "cpu" or rows.stride(-1) != 1 or gate_up.shape[-1] % 2:
            return None
        out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype)
        self._silu_and_mul(
            rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], width, code, torch.get_num_threads()
        )
        return out

    @staticmethod
    def decode_error(
        status: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int
    ) -> str:
        if status == 2:
            longest = int(seq_lens.max())
            need = cdiv(longest, block_size)
            return f"seq_lens up to {longest} need {need} blocks, block_tables has {block_tables.shape[1]}"
        if status == 3:
            return f"block_tables hold a block id outside the pool's {num_blocks} blocks"
        return f"decode_attention: the native kernel returned status {status}"


def native_decode_for(cache: torch.Tensor) -> NativeKernels | None:
    """The kernels when their decode attention can read ``cache`` (a CPU pool) in this process, else ``None``."""
    native = native_kernels() if cache.is_cpu else None
    return native if native is not None and native.supports_cache(cache) else None


@functools.cache
def native_kernels() -> NativeKernels | None:
    """This process's :class:`NativeKernels`, or ``None`` when they cannot be built, are turned off or the
    cache is unsafe (:class:`UnsafeKernelCache`); the reason is logged at warning level."""
    if os.environ.get("TGI_PAGED_NATIVE_CPU", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        return NativeKernels(build_library())
    except Exception as e:  # noqa: BLE001 - any failure means: the plain-torch paths serve
        logger.warning("native CPU kernels off, plain-torch paths serve instead (%s: %s)", type(e).__name__, e)
        return None
