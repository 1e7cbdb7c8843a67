"""Device side of the wgmma probe: bitwise comparisons and timings, through torch and the driver
API (ctypes). Cubins compiled ahead by NVRTC (build.sh): matmul.cubin (sm_90, today's kernels),
wg_BM_KPI_STAGES.cubin (sm_90a, cuda/matmul_wgmma.cu with those defines), probe.cubin (sm_90a,
probe.cu). Usage: python3 run.py DIR [BM_KPI_STAGES ...]"""
import ctypes, sys, os, json
import torch

D = sys.argv[1]
cu = ctypes.CDLL("libcuda.so.1")
torch.cuda.init()
torch.zeros(1, device="cuda")
def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUDA error {r}")

def module(path):
    data = open(path, "rb").read()
    m = ctypes.c_void_p()
    ck(cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(data)), f"load {path}")
    return m

def func(m, name, smem=0):
    f = ctypes.c_void_p()
    ck(cu.cuModuleGetFunction(ctypes.byref(f), m, name.encode()), name)
    if smem > 48 * 1024:
        ck(cu.cuFuncSetAttribute(f, 8, smem), f"smem {name}")
    return f

class Epi(ctypes.Structure):
    _fields_ = [("mode", ctypes.c_int), ("parts", ctypes.c_int), ("width", ctypes.c_int * 4), ("ptr", ctypes.c_uint64 * 4)]

def launch(f, grid, block, smem, args):
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor): vals.append(ctypes.c_uint64(a.data_ptr()))
        elif isinstance(a, tuple) and a[0] == "i64": vals.append(ctypes.c_int64(a[1]))
        elif isinstance(a, int): vals.append(ctypes.c_int32(a))
        elif isinstance(a, Epi): vals.append(a)
        elif a is None: vals.append(ctypes.c_uint64(0))
        else: raise TypeError(a)
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ck(cu.cuLaunchKernel(f, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, ptrs, None), "launch")

mm = module(f"{D}/matmul.cubin"); pr = module(f"{D}/probe.cubin")
LARGE_SMEM = 4 * (128 + 256) * 64 + 128 * 256 * 4
f_round = func(mm, "round_activations"); f_large = func(mm, "matmul_large", LARGE_SMEM)
f_probe = func(pr, "probe_mma")
VARIANTS = {}
for name in sys.argv[2:] or ["192_2_10"]:
    bm, kpi, stages = map(int, name.split("_"))
    wg = module(f"{D}/wg_{name}.cubin")
    smem = stages * (bm + 128) * 64
    VARIANTS[name] = (func(wg, "round_activations_wgmma"), func(wg, "matmul_wgmma", smem), bm, smem)
print(torch.cuda.get_device_name())

def wide_bf16(shape, spread):
    """bf16 values with exponents spread over +-spread and random signs (never zeros only)."""
    m = torch.rand(shape, device="cuda") + 1.0
    e = torch.randint(-spread, spread + 1, shape, device="cuda").float()
    s = torch.where(torch.rand(shape, device="cuda") < 0.5, -1.0, 1.0)
    return (s * m * torch.exp2(e))

def permute32(t):
    """Each 32-wide k block's bf16 pairs transposed 4 x 4 (pair 4c + q -> 4q + c)."""
    r, k = t.shape
    return t.view(r, k // 32, 4, 4, 2).transpose(2, 3).contiguous().view(r, k)

# 1. One-instruction probe.
mism = {"swapped": 0, "not_swapped": 0}
elems = 0
for trial in range(300):
    K = 32 * int(torch.randint(1, 160, (1,)))
    spread = [0, 4, 20, 40][trial % 4]
    x = wide_bf16((64, K), spread).bfloat16(); w = wide_bf16((64, K), spread).bfloat16()
    if trial % 5 == 4:  # heavy cancellation: w = +-x pattern
        w = (x[torch.randperm(64, device="cuda")] * torch.where(torch.rand(64, K, device="cuda") < 0.5, -1, 1)).bfloat16()
    ref = torch.full((64, 64), float("nan"), device="cuda"); swp = ref.clone(); nsw = ref.clone()
    launch(f_probe, (1, 1, 1), 128, 0, [ref, swp, nsw, x, w, permute32(x), permute32(w), K])
    torch.cuda.synchronize()
    assert not ref.isnan().any()
    mism["swapped"] += int((ref.view(torch.int32) != swp.view(torch.int32)).sum())
    mism["not_swapped"] += int((ref.view(torch.int32) != nsw.view(torch.int32)).sum())
    elems += 64 * 64
    if trial == 0:
        exact = x.double() @ w.double().t()
        print("probe rel err vs f64:", float((ref.double() - exact).norm() / exact.norm()))
print(f"PROBE one-instruction: {elems} elements over 300 trials; mismatches {mism}")

# 2. The kernel against matmul_large, bitwise.
def run_large(out, x, w, rows, N, K):
    xh = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    launch(f_round, ((x.numel() // 8 + 255) // 256, 1, 1), 256, 0, [xh, x, ("i64", x.numel() // 8)])
    launch(f_large, ((N + 255) // 256, (rows + 127) // 128, 1), 256, LARGE_SMEM, [out, xh, w, rows, N, K, None, None, None, 0, 1, None, Epi()])

def run_wg(out, x, w, rows, N, K, variant):
    f_round_wg, f_wg, bm, smem = VARIANTS[variant]
    xp = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    launch(f_round_wg, ((x.numel() // 32 + 255) // 256, 1, 1), 256, 0, [xp, x, ("i64", x.numel() // 32)])
    launch(f_wg, ((N + 127) // 128, (rows + bm - 1) // bm, 1), 256, smem, [out, xp, w, rows, N, K, Epi()])

total_bad = 0
for (rows, N, K, spread) in [(4096, 4096, 4096, 30), (4095, 12288, 4096, 10), (1000, 1000, 4192, 20), (257, 130, 544, 40), (129, 258, 96, 5), (513, 2051, 12288, 15), (4096, 248320 // 8, 4096, 3)]:
    x = wide_bf16((rows, K), spread).float(); w = wide_bf16((N, K), spread).bfloat16()
    a = torch.full((rows, N), float("nan"), device="cuda")
    run_large(a, x, w, rows, N, K)
    exact = x.bfloat16().double() @ w.double().t() if rows * N <= 4096 * 4096 else None
    for variant in VARIANTS:
        b = torch.full((rows, N), float("nan"), device="cuda")
        run_wg(b, x, w, rows, N, K, variant); torch.cuda.synchronize()
        bad = int((a.view(torch.int32) != b.view(torch.int32)).sum()); total_bad += bad
        rel = float((b.double() - exact).norm() / exact.norm()) if exact is not None else -1
        print(f"KERNEL {variant} {rows}x{N}x{K} spread {spread}: {bad} differ from matmul_large, nan {int(b.isnan().sum())}, rel err vs f64 {rel:.2e}")
        del b
    del a, x, w, exact
print("KERNEL total mismatches", total_bad)

# 3. Timings (median of events), rounding launch included for both kernels.
def timeit(fn, reps):
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
print("| M x N x K | matmul_large ms | " + " | ".join(f"wgmma {v} ms" for v in VARIANTS) + " | torch ms | best wgmma/torch | best TFLOP/s |")
for (M, N, K) in [(4096, 24576, 4096), (4096, 12288, 4096), (4096, 4096, 12288), (4096, 248320, 4096)]:
    x = torch.randn(M, K, device="cuda"); w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    out = torch.empty(M, N, device="cuda"); xb = x.bfloat16()
    reps = 5 if N > 100000 else 20
    tl = timeit(lambda: run_large(out, x, w, M, N, K), reps)
    tws = [timeit(lambda: run_wg(out, x, w, M, N, K, v), reps) for v in VARIANTS]
    tt = timeit(lambda: xb @ w.t(), reps)
    tw = min(tws)
    print(f"| {M} x {N} x {K} | {tl:.3f} | " + " | ".join(f"{t:.3f}" for t in tws) + f" | {tt:.3f} | {tt / tw:.2f} | {2 * M * N * K / tw / 1e9:.0f} |", flush=True)
    del x, w, out, xb
    torch.cuda.empty_cache()
