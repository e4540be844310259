"""cuMemGetInfo / cuDeviceTotalMem (what torch.cuda.mem_get_info reports) next to nvidia-smi."""
import ctypes, subprocess, json
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
n = ctypes.c_int(); cuda.cuDeviceGetCount(ctypes.byref(n))
out = []
for i in range(n.value):
    dev = ctypes.c_int(); cuda.cuDeviceGet(ctypes.byref(dev), i)
    total = ctypes.c_size_t(); cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
    ctx = ctypes.c_void_p(); assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    free, tot2 = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(tot2))
    smi = subprocess.run(["nvidia-smi", f"--id={i}", "--query-gpu=name,memory.total,memory.reserved,memory.used,memory.free,driver_version", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
    out.append({"index": i, "cuDeviceTotalMem": total.value, "cuMemGetInfo_total": tot2.value, "cuMemGetInfo_free_with_context": free.value, "nvidia_smi_name_total_reserved_used_free_driver": smi})
    cuda.cuCtxDestroy_v2(ctx)
print(json.dumps(out, indent=1))
