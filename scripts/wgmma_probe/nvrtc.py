import ctypes, sys
import os
lib = ctypes.CDLL(os.environ.get("KESTREL_NVRTC_LIB", "libnvrtc.so.13"))
def compile(src, name, opts, out_cubin):
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert r == 0, r
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(log.value.decode()[-6000:])
    if r != 0:
        print("COMPILE FAILED", r); sys.exit(1)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    open(out_cubin, "wb").write(buf.raw)
    print("cubin", out_cubin, n.value)
if __name__ == "__main__":
    # args: out.cubin arch file1 file2 ...
    out, arch = sys.argv[1], sys.argv[2]
    src = "".join(open(f).read() + "\n" for f in sys.argv[3:])
    compile(src, "m.cu", [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=true", "--ptxas-options=-v"], out)
