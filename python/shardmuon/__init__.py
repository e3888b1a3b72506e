"""shardmuon: distributed Muon for tensor-parallel training.

The C library does the work; this package binds its C ABI with ctypes (it never links
libtorch, so one build serves every PyTorch version). ``shardmuon.torch`` is the PyTorch
front end: ``shardmuon.torch.Muon``, ``shardmuon.torch.MuonWithAdamW`` and
``shardmuon.torch.TorchMuon`` (torch.optim.Muon's arguments).
"""

from ._capi import ShardmuonError, build_info, library_path, version

__all__ = ["ShardmuonError", "build_info", "library_path", "version"]
