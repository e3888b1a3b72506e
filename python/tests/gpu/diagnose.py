"""Stage by stage: where does shardmuon crash inside a PyTorch process on a GPU?"""
import ctypes
import faulthandler
import os
import sys

faulthandler.enable()
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..")]
import torch  # noqa: E402

print("torch", torch.__version__, torch.version.cuda, flush=True)
import shardmuon  # noqa: E402
from shardmuon import _capi as c  # noqa: E402

for line in open("/proc/self/maps"):
    if any(name in line for name in ("libcudart", "libcublasLt", "libnccl", "libshardmuon", "openblas", "libmpi.so")):
        print("  loaded:", line.split()[-1], flush=True)
print("library", shardmuon.library_path, shardmuon.build_info(), flush=True)
handle = ctypes.c_void_p()
c.check(c.lib.shardmuon_context_create(c.BACKEND_CUDA, 0, ctypes.byref(handle)))
print("context ok", flush=True)
comm = ctypes.c_void_p()
c.check(c.lib.shardmuon_comm_create_self(ctypes.byref(comm)))
x = torch.randn(256, 384, device="cuda")
layout = c.Layout(256, 384, c.REPLICATED, 1, None)
options = c.NsOptions()
c.check(c.lib.shardmuon_ns_options_default(ctypes.byref(options)))
stream = torch.cuda.current_stream().cuda_stream
print("stream", stream, flush=True)
c.check(c.lib.shardmuon_newton_schulz(handle, comm, x.data_ptr(), c.FLOAT32, ctypes.byref(layout), ctypes.byref(options), stream))
torch.cuda.synchronize()
print("newton-schulz ok, norm", x.norm().item(), flush=True)
import shardmuon.torch as st  # noqa: E402
p = torch.nn.Parameter(torch.randn(64, 32, device="cuda"))
p.grad = torch.randn_like(p)
st.Muon([p]).step()
torch.cuda.synchronize()
print("Muon step ok", flush=True)
