"""The dataset side: records held once (`records`: SharedList, SharedDict); gloader's datasets
themselves are public in `gloader.dataset`. Nothing here starts a process or touches CUDA.
"""
