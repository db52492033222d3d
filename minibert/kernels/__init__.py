"""Triton kernels, each file a lesson: reference -> kernel -> launcher -> test -> benchmark."""
