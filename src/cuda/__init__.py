"""CUDA C++ sources of qcoll, installed as package data (qcoll.cuda_src) and compiled at run time by qcoll.bindings."""
