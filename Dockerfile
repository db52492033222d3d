# minibert on a GPU cluster: NVIDIA's NGC PyTorch image plus minibert's few extra packages.
#
# Base: nvcr.io/nvidia/pytorch:26.07-py3 = PyTorch 2.13.0a0+9186a08b2c (nv26.07), Triton 3.7.1, CUDA 13.3,
# Python 3.12. minibert's Triton kernels need Triton >= 3.6; the 24.01 image of Megatron's guide ships
# PyTorch 2.2 with Triton 2.x, too old for them. The build fails below if the base's Triton is older.
#
#   docker build -t minibert .
#   docker run --gpus all --ipc=host --shm-size=16g --rm minibert                       # make train-small
#   docker run --gpus all --ipc=host --shm-size=16g --rm -v /data:/data minibert \
#       bash examples/bert_340m.sh /data/checkpoints /data/tensorboard /data/vocab.txt /data/corpus_text_sentence
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.07-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/minibert

# requirements.txt without its torch pin: the base's own CUDA build of torch stays (pip would replace it
# with a wheel from PyPI). The NGC image's pip constraints (/etc/pip/constraint.txt) keep the other
# packages it ships at their versions.
COPY requirements.txt .
RUN grep -v -E '^torch([<>=~! ]|$)' requirements.txt > /tmp/requirements-without-torch.txt \
    && python3 -m pip install --no-cache-dir -r /tmp/requirements-without-torch.txt \
    && python3 -c "import torch, triton; v = tuple(int(x) for x in triton.__version__.split('.')[:2]); \
assert v >= (3, 6), f'Triton {triton.__version__} < 3.6: use a newer base image'; \
print('torch', torch.__version__, '| triton', triton.__version__)"

COPY . .
CMD ["make", "train-small"]
