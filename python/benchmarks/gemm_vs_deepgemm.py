"""epmoe's FP8 grouped GEMMs beside DeepGEMM's, in one process, on the same tensors, timed in turns.

    python3 python/benchmarks/gemm_vs_deepgemm.py [G,M,N,K ...] [--data randn|codes] [--zipf]
        [--decode] [--rounds 5] [--iters 20] [--graph auto|on|off] [--json PATH] [--lib PATH]
        [--lib-b PATH] [--cutlass-lib [PATH]] [--cutlass-configs NAME,...]
    python3 python/benchmarks/gemm_vs_deepgemm.py --dry-run [...]     # no GPU needed

Why this script and not epmoe-bench gemm + deepgemm_gemm.py one after the other: under the power cap
the SM clock drifts down over a few hundred ms of FP8 work, so whichever program runs second meets
a slower clock, and the two programs fill their inputs differently (uniform random e4m3 codes
against randn * 0.5). Here every kernel of a shape runs on one set of inputs, and the kernels take
turns round by round on one stream.

Per shape (G groups of M rows, N x K weights; each group's segment padded to 128 rows):
  - inputs: A e4m3 [rows][K] with 1x128 scales, B e4m3 [G][N][K] with 128x128 scales. --data
    randn: torch.randn * 0.5 cast to e4m3 (as shared/peers/deepgemm_gemm.py); --data codes:
    uniformly random finite e4m3 codes with |v| < 16 (as epmoe-bench gemm's fill). Scales
    uniform in [0.001, 0.011) (as the peer script).
  - DeepGEMM's m_grouped_fp8_gemm_nt_contiguous and epmoe's L2 kernel: both outputs against a
    dequantized fp32 product on one group (a relative L2 error above --tol fails the shape) and
    against each other;
  - epmoe's L1 kernel (SwiGLU + FP8 requant epilogue) with B as W1 (N = 2I rows, prepare_w1 into a
    second buffer): its e4m3 outputs must be finite and its scales positive; its dequantized output
    against SwiGLU of the fp32 product is printed for information (FP8 rounding: a few 1e-2);
  - --rounds rounds, each timing every kernel for --iters back-to-back calls with CUDA events on
    one stream, the kernel order rotated by one each round.
Prints per kernel the median and best TFLOP/s over the rounds and the ratios epmoe / DeepGEMM
(of the medians, of the bests, and the median of the per-round ratios). FLOPs count valid rows
only (2 x rows x N x K), the same for every kernel.

Layouts: epmoe reads activation scales MN-major, scale[k/128][row] with a row stride of the pool's
rows; DeepGEMM takes them as a [rows][K/128] tensor. The scales are drawn as [rows][K/128] and
transposed once (a_sf.t().contiguous()); --deepgemm-sf mn (default) hands DeepGEMM the transposed
view of epmoe's buffer (MN-major with a 4-aligned stride, the layout DeepGEMM's kernel reads, so
it should need no copy; the kernels one call launches are listed per shape to show it),
--deepgemm-sf rows the row-major tensor, as the peer script does (DeepGEMM then transposes it
inside every call).

--lib-b PATH: a second build of the library (an experiment) whose L2 and L1 kernels run on the same
inputs and take the same turns as b_l2 / b_l1; its L2 output is checked against the reference like
the first's, and one more line per shape gives its ratios to DeepGEMM and to the first build.

--cutlass-lib [PATH]: CUTLASS's sm90 FP8 grouped GEMMs with block-scaled accumulation
(KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum), built by
tools/probes/build_cutlass_probe.sh into libepmoe_cutlass_probe.so (PATH; without one,
.gpu/bin/libepmoe_cutlass_probe.so). Each of its configs (--cutlass-configs: a subset, by name)
becomes one more kernel in the turns, cutlass:<config>, on the same tensors: created once per shape
(every host step, including a compact per-group copy of the activation scales, which CUTLASS's
grouped mainloop reads as [K/128][rows of the group]; not timed), run once into a NaN-filled output
and checked against the fp32 reference with --tol like DeepGEMM and L2. A config that fails to set
up or to match the reference fails the run (exit 1) and is left out of the turns (unless
--time-failed); the other kernels are still timed. One line per config and shape gives its
TFLOP/s, its ratios to DeepGEMM and, per round, the L2 kernel's time over its own (> 1: CUTLASS is
faster).

The library is libepmoe_gemm_ctypes.so (bench/ctypes/gemm_ctypes.cpp): --lib, else
$EPMOE_GEMM_CTYPES_LIB, else .gpu/bin/ (tools/stage_gpu.sh), else build/. The SM clock and board
power are sampled every 20 ms if pynvml imports. Exit status: 0, or 1 if a check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB_NAME = "libepmoe_gemm_ctypes.so"
LIB_VERSION = 1  # EPMOE_GEMM_CTYPES_VERSION
STATUS_NAMES = ["Ok", "InvalidArgument", "Unsupported", "CudaError", "NcclError", "Timeout", "Internal"]
DEFAULT_SHAPES = ["8,4096,4096,7168", "8,4096,7168,2048", "32,1024,4096,7168", "32,1024,7168,2048"]
NK_PAIRS = [(4096, 7168), (7168, 2048)]  # the DSV3 slice's L1 (N = 2I, K = H) and L2 (N = H, K = I)
KERNELS = ["deepgemm", "epmoe_l2", "epmoe_l1", "b_l2", "b_l1"]  # then cutlass:<config>, if any
CUTLASS_LIB_NAME = "libepmoe_cutlass_probe.so"
CUTLASS_LIB_VERSION = 1  # EPMOE_CUTLASS_PROBE_VERSION


# ---- shapes and the pool layout ------------------------------------------------------------------

@dataclass
class Shape:
    name: str
    rows: list  # valid rows of each group
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * sum(self.rows) * self.n * self.k


def zipf_rows(groups: int, total: int, s: float) -> list:
    """epmoe-bench gemm's zipf_rows: group i gets floor(total * (i+1)^-s / sum)."""
    w = [1.0 / (i + 1) ** s for i in range(groups)]
    return [int(math.floor(total * x / sum(w))) for x in w]


def parse_shape(text: str) -> Shape:
    m = re.fullmatch(r"(\d+),(\d+),(\d+),(\d+)", text)
    if not m:
        raise ValueError(f"bad shape '{text}' (want G,M,N,K)")
    g, rows, n, k = map(int, m.groups())
    # The same limits as epmoe-bench gemm --shape.
    if not (1 <= g <= 1024 and 0 <= rows <= 65536 and n >= 128 and n % 128 == 0 and k >= 128 and k % 128 == 0):
        raise ValueError(f"bad shape '{text}' (G in [1, 1024], M in [0, 65536], N and K positive multiples of 128)")
    return Shape(f"({text})", [rows] * g, n, k)


def pool_offsets(rows: list, align: int) -> tuple:
    """Group e owns [off[e], off[e] + rows[e]); segments start at multiples of align."""
    off = [0]
    for r in rows:
        off.append(off[-1] + (r + align - 1) // align * align)
    return off, max(off[-1], align)


# ---- the library ---------------------------------------------------------------------------------

class EpmoeError(RuntimeError):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class GemmLib:
    """ctypes over libepmoe_gemm_ctypes.so. Pointers are ints (tensor.data_ptr()), streams ints."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        P, Int, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.epmoe_gemm_ctypes_version.argtypes, lib.epmoe_gemm_ctypes_version.restype = [], Int
        lib.epmoe_gemm_ctypes_last_error.argtypes, lib.epmoe_gemm_ctypes_last_error.restype = [], ctypes.c_char_p
        lib.epmoe_gemm_ctypes_row_align.argtypes, lib.epmoe_gemm_ctypes_row_align.restype = [], Int
        lib.epmoe_gemm_ctypes_plan_l2.argtypes = [Int, Int, P, P, L, L, P, P, P, P, Int, Int, P, ctypes.POINTER(P)]
        lib.epmoe_gemm_ctypes_plan_l1.argtypes = [Int, Int, P, P, L, L, P, P, P, P, P, P, P, Int, Int,
                                                  ctypes.c_float, Int, P, P, P, ctypes.POINTER(P)]
        lib.epmoe_gemm_ctypes_launch.argtypes = [P, P, Int]
        lib.epmoe_gemm_ctypes_destroy.argtypes = [P]
        for f in ("plan_l2", "plan_l1", "launch", "destroy"):
            getattr(lib, "epmoe_gemm_ctypes_" + f).restype = Int
        # The BF16 kernels (python/benchmarks/bf16_gemm_turns.py), in builds that have them.
        self.has_bf16 = hasattr(lib, "epmoe_gemm_ctypes_plan_l2_bf16")
        if self.has_bf16:
            lib.epmoe_gemm_ctypes_plan_l2_bf16.argtypes = [Int, Int, P, P, L, P, P, Int, Int, P, ctypes.POINTER(P)]
            lib.epmoe_gemm_ctypes_plan_l1_bf16.argtypes = [Int, Int, P, P, L, P, P, P, P, Int, Int, ctypes.c_float,
                                                           P, P, ctypes.POINTER(P)]
            lib.epmoe_gemm_ctypes_plan_l2_bf16.restype = lib.epmoe_gemm_ctypes_plan_l1_bf16.restype = Int
        self.lib = lib
        version = lib.epmoe_gemm_ctypes_version()
        if version != LIB_VERSION:
            raise RuntimeError(f"{path}: library version {version}, this script speaks {LIB_VERSION}; rebuild")
        self.row_align = lib.epmoe_gemm_ctypes_row_align()

    def _check(self, code: int, what: str):
        if code != 0:
            msg = self.lib.epmoe_gemm_ctypes_last_error().decode(errors="replace")
            name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else str(code)
            raise EpmoeError(code, f"{what}: {name}: {msg}")

    def plan_l2(self, device, groups, count, offset, max_rows, scale_stride, *, a, a_scale, b, b_scale, n, k, out):
        plan = ctypes.c_void_p()
        self._check(self.lib.epmoe_gemm_ctypes_plan_l2(device, groups, count, offset, max_rows, scale_stride, a,
                                                       a_scale, b, b_scale, n, k, out, ctypes.byref(plan)),
                    "plan_l2")
        return plan

    def plan_l1(self, device, groups, count, offset, max_rows, scale_stride, *, x, x_scale, w1, w1_scale,
                w1_internal, w1_scale_internal, row_weight, n, k, clamp, pow2, a_out, a_scale_out, stream):
        plan = ctypes.c_void_p()
        self._check(self.lib.epmoe_gemm_ctypes_plan_l1(device, groups, count, offset, max_rows, scale_stride, x,
                                                       x_scale, w1, w1_scale, w1_internal, w1_scale_internal,
                                                       row_weight, n, k, clamp, pow2, a_out, a_scale_out, stream,
                                                       ctypes.byref(plan)), "plan_l1")
        return plan

    def plan_l2_bf16(self, device, groups, count, offset, max_rows, *, a, b, n, k, out):
        plan = ctypes.c_void_p()
        self._check(self.lib.epmoe_gemm_ctypes_plan_l2_bf16(device, groups, count, offset, max_rows, a, b, n, k, out,
                                                            ctypes.byref(plan)), "plan_l2_bf16")
        return plan

    def plan_l1_bf16(self, device, groups, count, offset, max_rows, *, x, w1, w1_internal, row_weight, n, k, clamp,
                     a_out, stream):
        plan = ctypes.c_void_p()
        self._check(self.lib.epmoe_gemm_ctypes_plan_l1_bf16(device, groups, count, offset, max_rows, x, w1,
                                                            w1_internal, row_weight, n, k, clamp, a_out, stream,
                                                            ctypes.byref(plan)), "plan_l1_bf16")
        return plan

    def launch(self, plan, stream: int, count: int):
        self._check(self.lib.epmoe_gemm_ctypes_launch(plan, stream, count), "launch")

    def destroy(self, plan):
        self.lib.epmoe_gemm_ctypes_destroy(plan)


class CutlassLib:
    """ctypes over libepmoe_cutlass_probe.so (tools/probes/cutlass_grouped_fp8.cu): CUTLASS's FP8
    grouped GEMMs, one handle per config and shape. Its calls return the same status codes as
    GemmLib's; launch() has GemmLib.launch's signature, so the turns treat both alike."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise SystemExit(f"gemm_vs_deepgemm: no {path}; build it with tools/probes/build_cutlass_probe.sh")
        self.path = path
        lib = ctypes.CDLL(str(path))
        P, Int, Str = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
        Ints = ctypes.POINTER(ctypes.c_int)
        lib.epmoe_cutlass_probe_version.argtypes, lib.epmoe_cutlass_probe_version.restype = [], Int
        lib.epmoe_cutlass_probe_last_error.argtypes, lib.epmoe_cutlass_probe_last_error.restype = [], Str
        lib.epmoe_cutlass_probe_num_configs.argtypes, lib.epmoe_cutlass_probe_num_configs.restype = [], Int
        lib.epmoe_cutlass_probe_config_name.argtypes, lib.epmoe_cutlass_probe_config_name.restype = [Int], Str
        # create(config, groups, counts, offsets, n, k, a, a_scale, scale_stride, b, b_scale, d, handle)
        lib.epmoe_cutlass_probe_create.argtypes = [Int, Int, Ints, Ints, Int, Int, P, P, Int, P, P, P,
                                                   ctypes.POINTER(P)]
        lib.epmoe_cutlass_probe_create.restype = Int
        lib.epmoe_cutlass_probe_run.argtypes, lib.epmoe_cutlass_probe_run.restype = [P, P], Int
        lib.epmoe_cutlass_probe_destroy.argtypes, lib.epmoe_cutlass_probe_destroy.restype = [P], None
        self.lib = lib
        version = lib.epmoe_cutlass_probe_version()
        if version != CUTLASS_LIB_VERSION:
            raise RuntimeError(f"{path}: library version {version}, this script speaks {CUTLASS_LIB_VERSION}; "
                               f"rebuild (tools/probes/build_cutlass_probe.sh)")
        self.configs = [lib.epmoe_cutlass_probe_config_name(i).decode()
                        for i in range(lib.epmoe_cutlass_probe_num_configs())]

    def _check(self, code: int, what: str):
        if code != 0:
            msg = self.lib.epmoe_cutlass_probe_last_error().decode(errors="replace")
            name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else str(code)
            raise EpmoeError(code, f"{what}: {name}: {msg}")

    def create(self, config: int, counts: list, offsets: list, *, n, k, a, a_scale, scale_stride, b, b_scale, d):
        """Group g: counts[g] rows from row offsets[g] (host lists). Synchronizes the device."""
        if len(offsets) < len(counts):
            raise ValueError(f"{len(counts)} counts but {len(offsets)} offsets")
        ints = ctypes.c_int * max(len(counts), 1)
        handle = ctypes.c_void_p()
        groups = len(counts)
        self._check(self.lib.epmoe_cutlass_probe_create(config, groups, ints(*counts), ints(*offsets[:groups]), n, k,
                                                        a, a_scale, scale_stride, b, b_scale, d, ctypes.byref(handle)),
                    "create")
        return handle

    def launch(self, handle, stream: int, count: int):
        run = self.lib.epmoe_cutlass_probe_run
        for _ in range(count):
            code = run(handle, stream)
            if code != 0:
                self._check(code, "run")

    def destroy(self, handle):
        self.lib.epmoe_cutlass_probe_destroy(handle)


def cutlass_selection(cut: CutlassLib, wanted) -> list:
    """The indices of the --cutlass-configs names (all configs without the option)."""
    if not wanted:
        return list(range(len(cut.configs)))
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in names if w not in cut.configs]
    if unknown or not names:
        raise SystemExit(f"--cutlass-configs: unknown {', '.join(unknown) or '(none given)'}; "
                         f"{cut.path} has {', '.join(cut.configs)}")
    return [cut.configs.index(w) for w in names]


def find_lib(arg) -> Path:
    for cand in (arg, os.environ.get("EPMOE_GEMM_CTYPES_LIB"), ROOT / ".gpu/bin" / LIB_NAME, ROOT / "build" / LIB_NAME):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise SystemExit(f"gemm_vs_deepgemm: no {LIB_NAME} (--lib, $EPMOE_GEMM_CTYPES_LIB, .gpu/bin/, build/); "
                     f"build the target epmoe_gemm_ctypes or run tools/stage_gpu.sh")


# ---- inputs, shared by DeepGEMM and epmoe ----------------------------------------------------------

def e4m3(torch, shape, data: str, device):
    if data == "randn":
        return (torch.randn(shape, device=device) * 0.5).to(torch.float8_e4m3fn)
    # Sign bit and a magnitude code below 0x58 (|v| < 16): finite, never NaN, as fill_e4m3.
    mag = torch.randint(0, 0x58, shape, dtype=torch.uint8, device=device)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=device) * 0x80
    return (mag | sign).view(torch.float8_e4m3fn)


def make_inputs(torch, sh: Shape, align: int, data: str, device) -> dict:
    G, N, K = len(sh.rows), sh.n, sh.k
    off, max_rows = pool_offsets(sh.rows, align)
    m_indices = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
    for e, r in enumerate(sh.rows):
        m_indices[off[e]:off[e] + r] = e
    a = e4m3(torch, (max_rows, K), data, device)
    a.view(torch.uint8)[m_indices < 0] = 0  # padding rows: zero (neither kernel stores them)
    b = torch.empty((G, N, K), dtype=torch.float8_e4m3fn, device=device)
    for e in range(G):  # one group at a time: randn's fp32 temporary stays N x K
        b[e] = e4m3(torch, (N, K), data, device)
    a_sf = torch.rand(max_rows, K // 128, device=device) * 0.01 + 0.001  # [rows][K/128], DeepGEMM's view
    b_sf = torch.rand(G, N // 128, K // 128, device=device) * 0.01 + 0.001
    # epmoe's MN-major scales: scale[k/128][row], row stride = max_rows (a multiple of 128, so of 4).
    a_sf_mn = a_sf.t().contiguous()
    return dict(off=off, max_rows=max_rows, scale_stride=max_rows, m_indices=m_indices, a=a, b=b, a_sf=a_sf,
                b_sf=b_sf, a_sf_mn=a_sf_mn,
                count=torch.tensor(sh.rows, dtype=torch.int32, device=device),
                offset=torch.tensor(off, dtype=torch.int32, device=device))


def reference_group(torch, t: dict, g: int, rows: int):
    """Dequantized fp32 A[g] x B[g]^T on group g's valid rows, from the row-major scales."""
    r0 = t["off"][g]
    xa = t["a"][r0:r0 + rows].float() * t["a_sf"][r0:r0 + rows].repeat_interleave(128, 1)
    wb = t["b"][g].float() * t["b_sf"][g].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return xa @ wb.t()


def rel_err(torch, x, ref) -> float:
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- clocks ----------------------------------------------------------------------------------------

class ClockSampler:
    """SM clock (MHz) and board power (W) every `period` s in a thread, if pynvml imports."""

    def __init__(self, torch, device: int, period: float = 0.02):
        self.samples, self.note, self._stop = [], "", threading.Event()
        self._thread = None
        try:
            import pynvml
        except ImportError:
            self.note = "not recorded (no pynvml)"
            return
        try:
            pynvml.nvmlInit()
            self.handle = self._handle(pynvml, torch, device)
        except Exception as ex:  # noqa: BLE001 (optional: any NVML failure only skips the clocks)
            self.note = f"not recorded ({ex!r})"
            return
        self.nvml, self.period = pynvml, period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _handle(nvml, torch, device: int):
        # Why by UUID: CUDA_VISIBLE_DEVICES renumbers CUDA's devices, not NVML's.
        want = str(getattr(torch.cuda.get_device_properties(device), "uuid", "")).removeprefix("GPU-")
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if want and uuid.removeprefix("GPU-") == want:
                return h
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            return nvml.nvmlDeviceGetHandleByIndex(device)
        raise RuntimeError("cannot match the CUDA device to an NVML device")

    def _run(self):
        while not self._stop.is_set():
            try:
                mhz = self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)
                watts = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
                self.samples.append((time.perf_counter(), mhz, watts))
            except Exception as ex:  # noqa: BLE001
                self.note = f"sampling stopped ({ex!r})"
                return
            self._stop.wait(self.period)

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def median_in(self, windows) -> dict | None:
        """Median SM clock and power over the samples inside the (t0, t1) host windows."""
        got = [(mhz, w) for t, mhz, w in self.samples if any(t0 <= t <= t1 for t0, t1 in windows)]
        if not got:
            return None
        return {"sm_mhz": statistics.median(m for m, _ in got), "watts": round(statistics.median(w for _, w in got), 1),
                "samples": len(got)}


# ---- one shape -------------------------------------------------------------------------------------

def run_shape(ctx, sh: Shape) -> dict:
    torch, lib, args, dev = ctx["torch"], ctx["lib"], ctx["args"], ctx["device"]
    G, N, K = len(sh.rows), sh.n, sh.k
    rec = {"shape": sh.name, "groups": G, "rows": sum(sh.rows), "n": N, "k": K, "data": args.data,
           "ok": True, "notes": []}
    if sum(sh.rows) == 0:
        rec["notes"].append("no rows: nothing to time")
        return rec
    torch.manual_seed(args.seed)
    t = make_inputs(torch, sh, ctx["align"], args.data, dev)
    rec["max_rows"] = t["max_rows"]
    max_rows, ss = t["max_rows"], t["scale_stride"]
    stream = torch.cuda.current_stream()
    raw = stream.cuda_stream

    # DeepGEMM, on the same tensors.
    d_dg = torch.zeros(max_rows, N, dtype=torch.bfloat16, device=dev)
    sf_mode = args.deepgemm_sf
    dg_sf = {"mn": t["a_sf_mn"].t(), "rows": t["a_sf"]}

    def dg_call():
        ctx["dg"].m_grouped_fp8_gemm_nt_contiguous((t["a"], dg_sf[sf_mode]), (t["b"], t["b_sf"]), d_dg,
                                                   t["m_indices"])

    try:
        dg_call()
    except Exception as ex:  # noqa: BLE001
        if sf_mode != "mn":
            raise
        rec["notes"].append(f"DeepGEMM refused the MN-major scale view ({repr(ex)[:200]}); row-major instead")
        sf_mode = "rows"
        dg_call()
    rec["deepgemm_sf"] = sf_mode

    # epmoe's L2 kernel.
    d_l2 = torch.zeros(max_rows, N, dtype=torch.bfloat16, device=dev)
    common = (dev, G, t["count"].data_ptr(), t["offset"].data_ptr(), max_rows, ss)
    plans = {"epmoe_l2": lib.plan_l2(*common, a=t["a"].data_ptr(), a_scale=t["a_sf_mn"].data_ptr(),
                                     b=t["b"].data_ptr(), b_scale=t["b_sf"].data_ptr(), n=N, k=K,
                                     out=d_l2.data_ptr())}
    # epmoe's L1 kernel: B as W1 (N = 2I rows: gate 0..I-1, up I..2I-1), prepared into w1_int.
    l1 = None
    if N % 256 == 0:
        l1 = dict(w1_int=torch.empty_like(t["b"]), w1s_int=torch.empty_like(t["b_sf"]),
                  row_w=torch.rand(max_rows, device=dev) * 0.5 + 0.25,
                  a=torch.zeros(max_rows, N // 2, dtype=torch.uint8, device=dev),
                  a_scale=torch.zeros(N // 256, ss, dtype=torch.float32, device=dev))
        plans["epmoe_l1"] = lib.plan_l1(*common, x=t["a"].data_ptr(), x_scale=t["a_sf_mn"].data_ptr(),
                                        w1=t["b"].data_ptr(), w1_scale=t["b_sf"].data_ptr(),
                                        w1_internal=l1["w1_int"].data_ptr(), w1_scale_internal=l1["w1s_int"].data_ptr(),
                                        row_weight=l1["row_w"].data_ptr(), n=N, k=K, clamp=0.0, pow2=0,
                                        a_out=l1["a"].data_ptr(), a_scale_out=l1["a_scale"].data_ptr(), stream=raw)
    else:
        rec["notes"].append(f"L1 skipped: N={N} is not 2I with I a multiple of 128")
    libs = {n: lib for n in plans}
    lib_b, b_out = ctx.get("lib_b"), {}
    if lib_b is not None:
        b_out["l2"] = torch.zeros(max_rows, N, dtype=torch.bfloat16, device=dev)
        plans["b_l2"] = lib_b.plan_l2(*common, a=t["a"].data_ptr(), a_scale=t["a_sf_mn"].data_ptr(),
                                      b=t["b"].data_ptr(), b_scale=t["b_sf"].data_ptr(), n=N, k=K,
                                      out=b_out["l2"].data_ptr())
        libs["b_l2"] = lib_b
        if l1 is not None:
            b_out["a"] = torch.zeros_like(l1["a"])
            b_out["a_scale"] = torch.zeros_like(l1["a_scale"])
            plans["b_l1"] = lib_b.plan_l1(*common, x=t["a"].data_ptr(), x_scale=t["a_sf_mn"].data_ptr(),
                                          w1=t["b"].data_ptr(), w1_scale=t["b_sf"].data_ptr(),
                                          w1_internal=l1["w1_int"].data_ptr(),
                                          w1_scale_internal=l1["w1s_int"].data_ptr(),
                                          row_weight=l1["row_w"].data_ptr(), n=N, k=K, clamp=0.0, pow2=0,
                                          a_out=b_out["a"].data_ptr(), a_scale_out=b_out["a_scale"].data_ptr(),
                                          stream=raw)
            libs["b_l1"] = lib_b
    ctx["libs"] = libs
    try:
        for n, p in plans.items():
            libs[n].launch(p, raw, 1)
        torch.cuda.synchronize()
        if args.kernel_list:
            # What one call of each puts on the GPU (DeepGEMM: one GEMM kernel, or a scale transpose
            # before it if it did not take the scale view as it is).
            rec["launched"] = {"deepgemm": kernels_launched(torch, dg_call),
                               "epmoe_l2": kernels_launched(torch, lambda: lib.launch(plans["epmoe_l2"], raw, 1))}
            print("  one call launches: " + "; ".join(f"{n}: {v}" for n, v in rec["launched"].items()), flush=True)
        check_outputs(torch, rec, t, sh, d_dg, d_l2, l1, args.tol)
        if b_out:
            check_b(torch, rec, t, sh, d_l2, l1, b_out, args.tol)
        timed, checks_ok = dict(plans), rec["ok"]
        if ctx.get("cutlass") is not None:
            # Its handles join `plans` (destroyed below); a config that failed is left out of the turns.
            timed.update(add_cutlass(ctx, rec, t, sh, d_dg, plans))
        if checks_ok or args.time_failed:
            time_in_turns(ctx, rec, sh, dg_call, timed)
    finally:
        torch.cuda.synchronize()
        for n, p in plans.items():
            libs[n].destroy(p)
    return rec


def add_cutlass(ctx, rec, t, sh, d_dg, plans) -> dict:
    """Each selected CUTLASS config on this shape's tensors: created (its handle added to `plans` and
    its library to ctx["libs"]), run once into a shared NaN-filled output and checked against the
    fp32 reference on the check group like DeepGEMM and L2 (above --tol fails the shape) and, for
    information, against DeepGEMM on all valid rows and for untouched padding rows. Returns the
    configs to time: those that passed, or all that were created with --time-failed."""
    torch, cut, args, dev = ctx["torch"], ctx["cutlass"], ctx["args"], ctx["device"]
    N, K = sh.n, sh.k
    raw = torch.cuda.current_stream().cuda_stream
    d = torch.empty(t["max_rows"], N, dtype=torch.bfloat16, device=dev)
    valid = t["m_indices"] >= 0
    g = rec["check_group"]
    rows, r0 = sh.rows[g], t["off"][g]
    ref = reference_group(torch, t, g, rows)
    timed, out, listed = {}, rec.setdefault("cutlass", {}), False
    for i in ctx["cutlass_configs"]:
        name = "cutlass:" + cut.configs[i]
        try:
            handle = cut.create(i, sh.rows, t["off"], n=N, k=K, a=t["a"].data_ptr(), a_scale=t["a_sf_mn"].data_ptr(),
                                scale_stride=t["scale_stride"], b=t["b"].data_ptr(), b_scale=t["b_sf"].data_ptr(),
                                d=d.data_ptr())
        except EpmoeError as ex:
            rec["ok"] = False
            rec["notes"].append(f"FAIL: {name}: {ex}")
            out[name] = {"error": str(ex)}
            continue
        plans[name] = handle
        ctx["libs"][name] = cut
        d.fill_(float("nan"))
        cut.launch(handle, raw, 1)
        torch.cuda.synchronize()
        err = rel_err(torch, d[r0:r0 + rows], ref)
        vs_dg = rel_err(torch, d[valid], d_dg[valid].float())
        untouched = bool(torch.isnan(d[~valid].float()).all())
        out[name] = {"vs_ref": err, "vs_deepgemm": vs_dg, "padding_untouched": untouched}
        rec["errors"][name + "_vs_ref"] = err
        print(f"  {name}: rel err vs fp32 ref {err:.2e} (group {g}), vs DeepGEMM (all rows) {vs_dg:.2e}, "
              f"padding rows {'untouched' if untouched else 'WRITTEN'}", flush=True)
        if args.kernel_list and not listed:  # one config is enough to show that a call is one kernel
            listed = True
            rec.setdefault("launched", {})[name] = kernels_launched(torch, lambda: cut.launch(handle, raw, 1))
            print(f"  one call launches: {name}: {rec['launched'][name]}", flush=True)
        if not err <= args.tol:  # NaN fails too
            rec["ok"] = False
            rec["notes"].append(f"FAIL: {name} rel err {err:.3e} > {args.tol:g} against the fp32 reference")
            if not args.time_failed:
                continue
        timed[name] = handle
    return timed


def check_b(torch, rec, t, sh, d_l2, l1, b_out, tol):
    """The second build's outputs: its L2 against the fp32 reference (fails the shape above tol) and,
    for information, whether its L2 and L1 outputs equal the first build's bitwise."""
    valid = t["m_indices"] >= 0
    g = rec["check_group"]
    rows, r0 = sh.rows[g], t["off"][g]
    err = rel_err(torch, b_out["l2"][r0:r0 + rows], reference_group(torch, t, g, rows))
    rec["errors"]["b_l2_vs_ref"] = err
    same_l2 = bool(torch.equal(b_out["l2"][valid], d_l2[valid]))
    line = f"  build b: L2 rel err vs fp32 ref {err:.2e}, L2 bitwise equal to the first build: {same_l2}"
    rec["b_l2_bitwise_equal"] = same_l2
    if l1 is not None and "a" in b_out:
        same_l1 = bool(torch.equal(b_out["a"][valid], l1["a"][valid]) and
                       torch.equal(b_out["a_scale"][:, valid], l1["a_scale"][:, valid]))
        rec["b_l1_bitwise_equal"] = same_l1
        line += f", L1 bitwise equal: {same_l1}"
    if not err <= tol:
        rec["ok"] = False
        rec["notes"].append(f"FAIL: build b L2 rel err {err:.3e} > {tol:g} against the fp32 reference")
    print(line, flush=True)


def kernels_launched(torch, fn):
    """The GPU activities of one fn() call (name: count) from torch's profiler, or why not."""
    try:
        from collections import Counter

        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = Counter(e.name[:90] for e in prof.events()
                        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        return dict(names) if names else "none seen"
    except Exception as ex:  # noqa: BLE001 (a diagnostic only)
        return f"unknown ({ex!r})"[:200]


def check_outputs(torch, rec, t, sh, d_dg, d_l2, l1, tol):
    valid = t["m_indices"] >= 0
    g = next(e for e, r in enumerate(sh.rows) if r > 0)
    rows, r0 = sh.rows[g], t["off"][g]
    ref = reference_group(torch, t, g, rows)
    errs = {"epmoe_l2_vs_ref": rel_err(torch, d_l2[r0:r0 + rows], ref),
            "deepgemm_vs_ref": rel_err(torch, d_dg[r0:r0 + rows], ref),
            "epmoe_l2_vs_deepgemm": rel_err(torch, d_l2[valid], d_dg[valid].float())}
    rec["check_group"] = g
    rec["errors"] = errs
    line = (f"  check on group {g} ({rows} rows): rel err vs fp32 ref: epmoe L2 {errs['epmoe_l2_vs_ref']:.2e}, "
            f"DeepGEMM {errs['deepgemm_vs_ref']:.2e}; epmoe L2 vs DeepGEMM (all rows) "
            f"{errs['epmoe_l2_vs_deepgemm']:.2e}")
    for key, who in (("epmoe_l2_vs_ref", "epmoe L2"), ("deepgemm_vs_ref", "DeepGEMM")):
        if not errs[key] <= tol:  # NaN fails too
            rec["ok"] = False
            rec["notes"].append(f"FAIL: {who} rel err {errs[key]:.3e} > {tol:g} against the fp32 reference")
    if l1 is not None:
        inter, a1, a1s, row_w = sh.n // 2, l1["a"], l1["a_scale"], l1["row_w"]
        q = a1[valid].view(torch.float8_e4m3fn).float()
        s = a1s[:, valid]
        finite = bool(torch.isfinite(q).all())
        positive = bool((s > 0).all() and torch.isfinite(s).all())
        # Information only: SwiGLU of the fp32 product (gate = columns 0..I-1, up = I..2I-1) times the
        # row weight, against the dequantized e4m3 output.
        gate, up = ref[:, :inter], ref[:, inter:]
        act = gate * torch.sigmoid(gate) * up * row_w[r0:r0 + rows, None]
        deq = (a1[r0:r0 + rows].view(torch.float8_e4m3fn).float() *
               a1s[:, r0:r0 + rows].t().repeat_interleave(128, 1))
        errs["epmoe_l1_dequant_vs_swiglu_ref"] = rel_err(torch, deq, act)
        rec["l1_finite"], rec["l1_scales_positive"] = finite, positive
        line += (f"; L1 outputs {'finite' if finite else 'NOT FINITE'}, scales "
                 f"{'> 0' if positive else 'NOT ALL > 0'}, dequantized vs SwiGLU ref "
                 f"{errs['epmoe_l1_dequant_vs_swiglu_ref']:.2e} (info)")
        if not (finite and positive):
            rec["ok"] = False
            rec["notes"].append("FAIL: L1 output not finite or a scale not positive")
        elif not errs["epmoe_l1_dequant_vs_swiglu_ref"] < 0.2:
            rec["notes"].append("WARNING: the L1 output is far from SwiGLU of the reference (a layout mismatch "
                                "in this script's L1 setup, or a kernel fault); not a failure, timed anyway")
    print(line, flush=True)


def time_in_turns(ctx, rec, sh, dg_call, plans):
    torch, libs, args = ctx["torch"], ctx["libs"], ctx["args"]
    iters = args.iters

    def batch_of(name):
        if name == "deepgemm":
            def batch():
                for _ in range(iters):
                    dg_call()
        else:
            plan, lib = plans[name], libs[name]

            def batch():  # the current stream: the timing stream, or a graph's capture stream
                lib.launch(plan, torch.cuda.current_stream().cuda_stream, iters)
        return batch

    names = [n for n in KERNELS if n == "deepgemm" or n in plans] + [n for n in plans if n not in KERNELS]
    fns = {n: batch_of(n) for n in names}
    use_graph = args.graph == "on" or (args.graph == "auto" and sum(sh.rows) <= 128 * len(sh.rows))
    for n in names:  # warm-up, before any capture
        for _ in range(args.warmup):
            fns[n]()
    torch.cuda.synchronize()
    if use_graph:
        # Why graphs for decode shapes: a call there is a few microseconds of GPU time, less than
        # DeepGEMM's Python-side cost per call, so an eager loop would time the host.
        graphs = {}
        try:
            for n in names:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fns[n]()
                graphs[n] = g
            fns = {n: graphs[n].replay for n in names}
        except Exception as ex:  # noqa: BLE001
            torch.cuda.synchronize()
            rec["notes"].append(f"graph capture failed ({repr(ex)[:200]}); timed eagerly")
            use_graph = False
    rec["graph"] = use_graph
    rec["iters"], rec["rounds"] = iters, args.rounds
    if "b_l2" in names and args.rounds % len(names):
        # Why: the rotation gives each kernel every position in the turns only over len(names)
        # rounds (measured on one H100: build b's unchanged L1 kernel read 0.95-1.12x main's over
        # three rounds of five kernels, 1.00-1.05x over five).
        rec["notes"].append(f"WARNING: {args.rounds} rounds of {len(names)} kernels: not every kernel took every "
                            f"position in the turns; use a multiple of {len(names)} rounds for A/B ratios")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = {n: [] for n in names}
    windows = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            start.record()
            fns[n]()
            end.record()
            end.synchronize()
            windows[n].append((t0, time.perf_counter()))
            ms[n].append(start.elapsed_time(end) / iters)
    flops = sh.flops
    kern = {}
    for n in names:
        med, best = statistics.median(ms[n]), min(ms[n])
        kern[n] = {"ms": [round(x, 4) for x in ms[n]], "median_ms": round(med, 4), "best_ms": round(best, 4),
                   "median_tflops": round(flops / (med * 1e9), 1), "best_tflops": round(flops / (best * 1e9), 1),
                   "clock": ctx["clock"].median_in(windows[n])}
    dg = ms["deepgemm"]
    for n in names[1:]:
        k = kern[n]
        # Ratios of TFLOP/s (same FLOPs): DeepGEMM's time over ours, from the unrounded times.
        k["ratio_median"] = round(statistics.median(dg) / statistics.median(ms[n]), 3)
        k["ratio_best"] = round(min(dg) / min(ms[n]), 3)
        # The drift-free figure: each round's ratio against the same round's DeepGEMM time.
        paired = [d / o for d, o in zip(dg, ms[n], strict=True)]
        k["ratio_paired_median"] = round(statistics.median(paired), 3)
    for n in ("b_l2", "b_l1"):
        if n in kern and "epmoe" + n[1:] in kern:
            # build b against the first build, per round (its time over b's: > 1 means b is faster)
            paired = [a / b for a, b in zip(ms["epmoe" + n[1:]], ms[n], strict=True)]
            kern[n]["vs_first_paired_median"] = round(statistics.median(paired), 3)
    for n in names:
        if n.startswith("cutlass:") and "epmoe_l2" in kern:
            # the L2 kernel's time over CUTLASS's, per round: > 1 means CUTLASS is faster
            paired = [a / b for a, b in zip(ms["epmoe_l2"], ms[n], strict=True)]
            kern[n]["l2_over_paired_median"] = round(statistics.median(paired), 3)
    rec["kernels"] = kern


# ---- output ----------------------------------------------------------------------------------------

def header(args):
    print(f"TFLOP/s, median / best of {args.rounds} rounds x {args.iters} calls, kernels in turns; "
          f"ratios to DeepGEMM: of the medians / of the bests / median of the per-round ratios")
    print(f"{'shape (G,M,N,K)':28s} {'data':6s} {'DeepGEMM':>15s} | {'epmoe L2':>15s} {'L2 / DeepGEMM':>18s} | "
          f"{'epmoe L1':>15s} {'L1 / DeepGEMM':>18s} | SM MHz (DG/L2/L1)", flush=True)
    if args.cutlass_lib:
        print("  then one line per CUTLASS config: its TFLOP/s and ratios to DeepGEMM, the L2 kernel's time over "
              "its own per round (> 1: CUTLASS faster), its SM MHz", flush=True)


def row_line(rec) -> str:
    k = rec.get("kernels")
    if not k:
        return f"{rec['shape']:28s} {rec['data']:6s} not timed: {'; '.join(rec['notes'])}"

    def tf(n):
        return f"{k[n]['median_tflops']:7.1f}/{k[n]['best_tflops']:<7.1f}" if n in k else f"{'-':>15s}"

    def ratio(n):
        return (f"{k[n]['ratio_median']:.3f}/{k[n]['ratio_best']:.3f}/{k[n]['ratio_paired_median']:.3f}"
                if n in k else f"{'-':>18s}")

    clocks = "/".join(str(k[n]["clock"]["sm_mhz"]) if n in k and k[n]["clock"] else "-" for n in KERNELS[:3])
    graph = " (graphs)" if rec.get("graph") else ""
    line = (f"{rec['shape']:28s} {rec['data']:6s} {tf('deepgemm')} | {tf('epmoe_l2')} {ratio('epmoe_l2'):>18s} | "
            f"{tf('epmoe_l1')} {ratio('epmoe_l1'):>18s} | {clocks}{graph}")
    if "b_l2" in k:
        def vs(n):
            return f"{k[n]['vs_first_paired_median']:.3f}" if n in k and "vs_first_paired_median" in k[n] else "-"
        line += (f"\n{'  build b':28s} {'':6s} {'':15s} | {tf('b_l2')} {ratio('b_l2'):>18s} | "
                 f"{tf('b_l1')} {ratio('b_l1'):>18s} | b over first (per round): L2 {vs('b_l2')} L1 {vs('b_l1')}")
    for n in (x for x in k if x.startswith("cutlass:")):
        l2_over = f"{k[n]['l2_over_paired_median']:.3f}" if "l2_over_paired_median" in k[n] else "-"
        mhz = k[n]["clock"]["sm_mhz"] if k[n]["clock"] else "-"
        line += (f"\n{'  ' + n:51s} | {tf(n)} {ratio(n):>18s} | L2 / CUTLASS (per round) {l2_over} | SM MHz {mhz}")
    return line


def shapes_from(args) -> list:
    listed = args.shapes or ([] if args.no_defaults else DEFAULT_SHAPES)
    shapes = [parse_shape(s) for s in listed]
    if args.zipf:
        for n, k in NK_PAIRS:
            shapes.append(Shape(f"zipf(32,{args.zipf_rows},{n},{k})", zipf_rows(32, args.zipf_rows, args.zipf_s), n, k))
    if args.decode:
        for n, k in NK_PAIRS:
            for m in (8, 64):
                shapes.append(Shape(f"decode(32,{m},{n},{k})", [m] * 32, n, k))
    if not shapes:
        raise ValueError("no shapes (--no-defaults without --zipf, --decode or G,M,N,K)")
    return shapes


def git_commit(lib_path: Path | None = None) -> str:
    """The tree the library was built from: the COMMIT file that tools/stage_gpu.sh writes next to
    it (on the GPU machines the copy's git metadata can be stale), else this checkout's HEAD."""
    stamp = lib_path.parent / "COMMIT" if lib_path is not None else None
    if stamp is not None and stamp.is_file():
        text = " ".join(stamp.read_text().split())
        if text:
            return f"{text} (staged)"
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


# ---- the dry run: no GPU, no torch needed --------------------------------------------------------

def dry_run(args, shapes) -> int:
    lib = GemmLib(find_lib(args.lib))
    print(f"library {lib.path}: version {LIB_VERSION}, row_align {lib.row_align}")
    failures = []
    if args.lib_b:
        lib_b = GemmLib(Path(args.lib_b))
        print(f"build b {lib_b.path}: row_align {lib_b.row_align}")
        if lib_b.row_align != lib.row_align:
            failures.append(f"--lib-b: row_align {lib_b.row_align} differs from {lib.row_align}")

    def expect_invalid(what, call, pattern):
        try:
            call()
            failures.append(f"{what}: accepted")
        except EpmoeError as ex:
            if ex.code != 1 or not re.search(pattern, str(ex)):
                failures.append(f"{what}: got '{ex}', want InvalidArgument matching '{pattern}'")

    if args.cutlass_lib:
        failures += cutlass_dry_run(args, expect_invalid)

    # Each pointer misaligned in turn: the library names the parameter it landed in, so this checks
    # the argument order of the ctypes signatures against the C functions. Device -1 (the current
    # one): the checks come before any CUDA call.
    ok = 1 << 20
    grid = (-1, 4, ok, ok, 512, 512)  # device, groups, count, offset, max_rows, scale_stride
    l2 = dict(a=ok, a_scale=ok, b=ok, b_scale=ok, n=256, k=256, out=ok)
    for p, name in dict(a="a", a_scale="a_scale", b="w2", b_scale="w2_scale", out="o").items():
        expect_invalid(f"plan_l2 with {p} misaligned", lambda p=p: lib.plan_l2(*grid, **dict(l2, **{p: ok + 8})),
                       rf"gemm::l2: {name} must be 16-byte aligned")
    l1 = dict(x=ok, x_scale=ok, w1=ok, w1_scale=ok, w1_internal=ok, w1_scale_internal=ok, row_weight=ok, n=512,
              k=256, clamp=0.0, pow2=0, a_out=ok, a_scale_out=ok, stream=None)
    for p, name in dict(x="x", x_scale="x_scale", w1_internal="w1", w1_scale_internal="w1_scale",
                        row_weight="row_weight", a_out="a", a_scale_out="a_scale").items():
        expect_invalid(f"plan_l1 with {p} misaligned", lambda p=p: lib.plan_l1(*grid, **dict(l1, **{p: ok + 8})),
                       rf"gemm::l1: {name} must be 16-byte aligned")
    expect_invalid("plan_l2 with a null pointer", lambda: lib.plan_l2(*grid, **dict(l2, b_scale=None)), "null")
    expect_invalid("plan_l2 without expert counts",
                   lambda: lib.plan_l2(-1, 4, None, ok, 512, 512, **l2), "expert_count and expert_offset")
    expect_invalid("plan_l2 with n=200", lambda: lib.plan_l2(*grid, **dict(l2, n=200)), "n=200 and k=256")
    expect_invalid("plan_l2 with scale_stride=510 (max_rows and the scale stride in their places)",
                   lambda: lib.plan_l2(-1, 4, ok, ok, 384, 510, **l2), "scale_stride=510 must be >= max_rows=384")
    expect_invalid("plan_l2 with groups=0", lambda: lib.plan_l2(-1, 0, ok, ok, 512, 512, **l2), "num_groups=0")
    expect_invalid("plan_l1 with n=384", lambda: lib.plan_l1(*grid, **dict(l1, n=384)), "n=384")
    expect_invalid("plan_l1 with k=200", lambda: lib.plan_l1(*grid, **dict(l1, k=200)), "k=200")
    expect_invalid("plan_l1 with a NaN clamp", lambda: lib.plan_l1(*grid, **dict(l1, clamp=float("nan"))),
                   r"clamp=-?nan must be finite")
    expect_invalid("launch of a null plan", lambda: lib.launch(None, 0, 1), "plan is null")
    expect_invalid("device -2", lambda: lib.plan_l2(-2, 4, ok, ok, 512, 512, **l2), "device=-2")
    # The layout of every shape, as the GPU run will lay it out (align: epmoe's; DeepGEMM's is
    # read at run time and the larger of the two is used).
    print(f"{'shape':28s} {'groups':>6s} {'rows':>7s} {'pool rows':>9s} {'GFLOP':>9s}  L1")
    for sh in shapes:
        _, max_rows = pool_offsets(sh.rows, lib.row_align)
        l1_note = "yes" if sh.n % 256 == 0 else "skipped (N not 2 x a multiple of 128)"
        print(f"{sh.name:28s} {len(sh.rows):6d} {sum(sh.rows):7d} {max_rows:9d} {sh.flops / 1e9:9.1f}  {l1_note}")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        failures += layout_selftest(torch, lib.row_align)
        print(f"layout self-test on the CPU (torch {torch.__version__}): {'see below' if failures else 'ok'}")
    else:
        print("layout self-test skipped (no torch)")
    for f in failures:
        print("FAIL:", f)
    print("dry run: " + ("ok" if not failures else f"{len(failures)} failure(s)"))
    return 0 if not failures else 1


def cutlass_dry_run(args, expect_invalid) -> list:
    """--cutlass-lib without a GPU: the version and configs, and bad create() calls refused with their
    message before any CUDA call (each pointer misaligned in turn checks the ctypes argument order)."""
    cut = CutlassLib(Path(args.cutlass_lib))
    picked = cutlass_selection(cut, args.cutlass_configs)
    print(f"CUTLASS probe {cut.path}: version {CUTLASS_LIB_VERSION}, {len(cut.configs)} configs, timing "
          + ", ".join(cut.configs[i] for i in picked))
    failures = []
    if cut.lib.epmoe_cutlass_probe_config_name(len(cut.configs)) is not None:
        failures.append("cutlass: a config name past the last config")
    ok = 1 << 20
    counts, offsets = [130, 0, 5], [0, 256, 256]
    good = dict(n=256, k=384, a=ok, a_scale=ok, scale_stride=512, b=ok, b_scale=ok, d=ok)

    def create(config=0, c=counts, o=offsets, **kw):
        return cut.create(config, c, o, **dict(good, **kw))

    for p in ("a", "a_scale", "b", "b_scale", "d"):
        expect_invalid(f"cutlass create with {p} misaligned", lambda p=p: create(**{p: ok + 8}),
                       rf"create: {p} must be 16-byte aligned")
    expect_invalid("cutlass create with a null pointer", lambda: create(b_scale=None), "one is null")
    expect_invalid("cutlass create with n=200", lambda: create(n=200), "n=200 and k=384")
    expect_invalid("cutlass create with config -1", lambda: create(-1),
                   rf"config=-1 must be in \[0, {len(cut.configs)}\)")
    expect_invalid("cutlass create past the last config", lambda: create(len(cut.configs)), "config=")
    expect_invalid("cutlass create with no groups", lambda: create(c=[], o=[]), "groups=0")
    expect_invalid("cutlass create with an offset not a multiple of 128", lambda: create(o=[0, 200, 256]),
                   "group 1: count=0 .* offset=200")
    expect_invalid("cutlass create with a group past scale_stride", lambda: create(scale_stride=260),
                   "group 2 ends at row 261, past scale_stride=260")
    try:
        cut.launch(None, 0, 1)
        failures.append("cutlass run of a null handle: accepted")
    except EpmoeError as ex:
        if ex.code != 1 or "handle is null" not in str(ex):
            failures.append(f"cutlass run of a null handle: got '{ex}'")
    return failures


def layout_selftest(torch, align: int) -> list:
    """The inputs as built for the GPU run, on the CPU: the scale views that each kernel reads hold
    the values the reference uses, and a plain emulation of epmoe's documented contract (MN-major
    scale[k/128][row] at stride scale_stride, [G][N/128][K/128] weight scales, segments at the
    offsets) matches reference_group on every group."""
    failures = []
    sh = Shape("selftest", [130, 0, 5], 256, 384)
    for data in ("randn", "codes"):
        torch.manual_seed(1)
        t = make_inputs(torch, sh, align, data, "cpu")
        if not bool(torch.isfinite(t["a"].float()).all() and torch.isfinite(t["b"].float()).all()):
            failures.append(f"{data}: non-finite e4m3 input")
        if data == "codes" and not float(t["b"].float().abs().max()) < 16:
            failures.append("codes: |v| >= 16")
        dg_view = t["a_sf_mn"].t()
        if dg_view.stride() != (1, t["scale_stride"]) or not torch.equal(dg_view, t["a_sf"]):
            failures.append(f"{data}: the MN-major view's strides {dg_view.stride()} or values differ")
        flat_sf = t["a_sf_mn"].reshape(-1)
        for g, rows in enumerate(sh.rows):
            if rows == 0:
                continue
            r0 = t["off"][g]
            if not bool((t["m_indices"][r0:r0 + rows] == g).all()):
                failures.append(f"{data}: m_indices of group {g}")
            out = torch.zeros(rows, sh.n)
            for kb in range(sh.k // 128):
                ks = slice(kb * 128, kb * 128 + 128)
                part = t["a"][r0:r0 + rows, ks].float() @ t["b"][g][:, ks].float().t()
                a_s = flat_sf[kb * t["scale_stride"] + r0: kb * t["scale_stride"] + r0 + rows]
                b_s = t["b_sf"][g][:, kb].repeat_interleave(128)
                out += part * a_s[:, None] * b_s[None, :]
            err = rel_err(torch, out, reference_group(torch, t, g, rows))
            if not err < 1e-5:
                failures.append(f"{data}: emulated epmoe L2 of group {g} vs the reference: {err:.2e}")
        pad = t["m_indices"] < 0
        if int(pad.sum()) != t["max_rows"] - sum(sh.rows) or bool(t["a"][pad].float().abs().max() != 0):
            failures.append(f"{data}: padding rows")
    return failures


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("shapes", nargs="*", metavar="G,M,N,K",
                   help="G groups of M rows, N x K weights (default: " + " ".join(DEFAULT_SHAPES) + ")")
    p.add_argument("--no-defaults", action="store_true",
                   help="without G,M,N,K: no default shapes (with --zipf / --decode)")
    p.add_argument("--zipf", action="store_true", help="add 32 groups of Zipf-distributed rows (--zipf-rows in all) "
                                                       "at N,K = 4096,7168 and 7168,2048")
    p.add_argument("--zipf-rows", type=int, default=32768)
    p.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent (epmoe-bench gemm's 1.1)")
    p.add_argument("--decode", action="store_true", help="add 32 groups of 8 and of 64 rows at both N,K")
    p.add_argument("--data", choices=["randn", "codes"], default="randn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed batch")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches of each kernel first")
    p.add_argument("--graph", choices=["auto", "on", "off"], default="auto",
                   help="time CUDA-graph replays of each batch; auto: for shapes of <= 128 rows per group")
    p.add_argument("--deepgemm-sf", choices=["mn", "rows"], default="mn",
                   help="DeepGEMM's activation scales: epmoe's MN-major buffer (no copy) or row-major")
    p.add_argument("--no-kernel-list", dest="kernel_list", action="store_false",
                   help="skip listing (torch profiler) the GPU activities of one DeepGEMM and one epmoe call")
    p.add_argument("--tol", type=float, default=1e-2, help="bound of the rel err against the fp32 reference")
    p.add_argument("--time-failed", action="store_true",
                   help="time a shape even when an output check failed (experiment builds that skip work, "
                        "e.g. loads only); the run still ends FAILED")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--lib", help=f"path of {LIB_NAME}")
    p.add_argument("--lib-b", metavar="PATH", help=f"a second build of {LIB_NAME}, timed in the same turns")
    p.add_argument("--cutlass-lib", metavar="PATH", nargs="?", const=str(ROOT / ".gpu/bin" / CUTLASS_LIB_NAME),
                   help=f"{CUTLASS_LIB_NAME} (tools/probes/build_cutlass_probe.sh): its CUTLASS grouped GEMM "
                        f"configs join the turns (PATH default: .gpu/bin/{CUTLASS_LIB_NAME})")
    p.add_argument("--cutlass-configs", metavar="NAME,...",
                   help="with --cutlass-lib: only these configs (default: all the library has)")
    p.add_argument("--json", metavar="PATH", help="write the run (settings, clocks, every shape) as JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: load the library, check its argument checks, print the shapes' layouts")
    args = p.parse_args(argv)
    if args.cutlass_lib and re.fullmatch(r"\d+,\d+,\d+,\d+", args.cutlass_lib):
        # `--cutlass-lib G,M,N,K ...`: argparse gave the first shape to the optional PATH.
        args.shapes.insert(0, args.cutlass_lib)
        args.cutlass_lib = str(ROOT / ".gpu/bin" / CUTLASS_LIB_NAME)
    if args.cutlass_configs and not args.cutlass_lib:
        p.error("--cutlass-configs needs --cutlass-lib")
    for name in ("rounds", "iters", "zipf_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or not args.tol > 0:
        p.error("--warmup must be >= 0 and --tol > 0")
    try:
        shapes = shapes_from(args)
    except ValueError as ex:
        p.error(str(ex))
    return args, shapes


def copy_gbs(torch, device, nbytes=1 << 30, reps=5) -> float:
    """Device-to-device copy bandwidth in this process: (read + write) bytes per second, best of
    `reps` copies of `nbytes`. The decode shapes' weight streams are compared with it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * nbytes / best / 1e9


def weight_line(rec, sh, copy) -> str:
    """For a decode shape: the rate at which each kernel streams the weights (e4m3 plus the 128 x 128
    fp32 scales), against a device-to-device copy's (read + write) bandwidth in the same process."""
    groups = len(sh.rows)
    wbytes = groups * sh.n * sh.k + groups * (sh.n // 128) * (sh.k // 128) * 4
    parts = []
    for n, k in rec["kernels"].items():
        gbs = wbytes / (k["median_ms"] * 1e-3) / 1e9
        k["weight_gbs"] = round(gbs, 1)
        k["weight_over_copy"] = round(gbs / copy, 3)
        parts.append(f"{n} {gbs:7.1f} GB/s ({gbs / copy:.2f}x)")
    return f"  weights {wbytes / 1e6:.0f} MB: " + ", ".join(parts) + f"; D2D copy {copy:.0f} GB/s"


def main(argv=None) -> int:
    args, shapes = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        return dry_run(args, shapes)
    import torch
    import deep_gemm
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    torch.cuda.set_device(args.device)
    lib = GemmLib(find_lib(args.lib))
    dg_align = int(getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout", lambda: 128)())
    align = lib.row_align * dg_align // math.gcd(lib.row_align, dg_align)
    clock = ClockSampler(torch, args.device)
    lib_b = GemmLib(Path(args.lib_b)) if args.lib_b else None
    if lib_b is not None and lib_b.row_align != lib.row_align:
        raise SystemExit(f"--lib-b: row_align {lib_b.row_align} differs from the first build's {lib.row_align}")
    cut = CutlassLib(Path(args.cutlass_lib)) if args.cutlass_lib else None
    cut_configs = cutlass_selection(cut, args.cutlass_configs) if cut else []
    ctx = dict(torch=torch, dg=deep_gemm, lib=lib, lib_b=lib_b, args=args, device=args.device, align=align,
               clock=clock, cutlass=cut, cutlass_configs=cut_configs)
    meta = {"gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
            "deep_gemm": getattr(deep_gemm, "__version__", "?"), "commit": git_commit(lib.path), "lib": str(lib.path),
            "lib_b": str(lib_b.path) if lib_b else None,
            "cutlass_lib": str(cut.path) if cut else None, "cutlass_configs": [cut.configs[i] for i in cut_configs],
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "data": args.data, "rounds": args.rounds,
            "iters": args.iters, "warmup": args.warmup, "graph": args.graph, "deepgemm_sf": args.deepgemm_sf,
            "seed": args.seed, "row_align": align, "tol": args.tol}
    print(f"gemm_vs_deepgemm on {meta['gpu']}: deep_gemm {meta['deep_gemm']}, torch {meta['torch']}, "
          f"commit {meta['commit']}, --data {args.data}, segment alignment {align}, clocks: "
          f"{clock.note or 'sampled by NVML'}", flush=True)
    copy = copy_gbs(torch, args.device) if any(sum(sh.rows) <= 128 * len(sh.rows) for sh in shapes) else None
    if copy:
        meta["copy_gbs"] = round(copy, 1)
    header(args)
    records, failed = [], False
    s = torch.cuda.Stream(args.device)

    def dump():  # after every shape: a run killed at its time limit keeps what it measured
        if args.json:
            t0 = clock.samples[0][0] if clock.samples else 0.0
            meta["clock_note"] = clock.note
            meta["clock_samples"] = [[round(t - t0, 3), m, w] for t, m, w in list(clock.samples)]
            Path(args.json).write_text(json.dumps({"meta": meta, "shapes": records}, indent=1) + "\n")

    for sh in shapes:
        try:
            with torch.cuda.stream(s):
                rec = run_shape(ctx, sh)
        except Exception as ex:  # noqa: BLE001 (one shape's failure must not hide the others)
            rec = {"shape": sh.name, "data": args.data, "ok": False, "notes": [f"FAIL: {ex!r}"[:600]]}
        failed |= not rec["ok"]
        records.append(rec)
        print(row_line(rec), flush=True)
        if copy and rec.get("kernels") and sum(sh.rows) <= 128 * len(sh.rows):
            print(weight_line(rec, sh, copy), flush=True)
        for note in rec["notes"]:
            print("  " + note, flush=True)
        torch.cuda.empty_cache()
        dump()
    clock.stop()
    if clock.samples:
        mhz = [m for _, m, _ in clock.samples]
        meta["clock_sm_mhz"] = {"min": min(mhz), "median": statistics.median(mhz), "max": max(mhz),
                                "samples": len(mhz)}
        print(f"SM clock over the run: {min(mhz)}-{max(mhz)} MHz, median {statistics.median(mhz)} "
              f"({len(mhz)} samples)")
    dump()
    print("FAILED: see the FAIL lines above" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
