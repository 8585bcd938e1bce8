"""torch's test_optim.py is not collected on its own (it imports PyTorch's test/optim package):
tests/optimizer/test_torch_optim_renewed.py loads it and runs its generic suite on Muon and
MuonForeach."""

collect_ignore = ["test_optim.py"]
