"""The Dockerfile, checked without Docker (none runs here): the NGC base is named with the versions it
ships and its Triton is new enough for minibert's kernels, what the file copies and runs exists, torch is
not reinstalled over the base's own build, and the chapter's `docker build` / `docker run` lines use the
same image name and the flags multi-process training needs."""
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTER = os.path.join(ROOT, "chapters", "07-scaling.md")


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def instructions():
    """[(INSTRUCTION, arguments)] with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", "", read("Dockerfile"))
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_base_is_an_ngc_pytorch_image_named_with_its_versions():
    text = read("Dockerfile")
    (base,) = [rest for word, rest in instructions() if word == "ARG" and rest.startswith("BASE_IMAGE=")]
    tag = base.split("=", 1)[1]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", tag), tag
    assert ("FROM", "${BASE_IMAGE}") in instructions()
    release = tag.split(":")[1].removesuffix("-py3")
    comment = next(line for line in text.splitlines() if line.startswith("#") and tag in line)
    assert f"(nv{release})" in comment or f"nv{release}" in comment, comment  # the torch build of that release
    triton = re.search(r"Triton (\d+)\.(\d+)\.\d+", comment)
    assert triton and (int(triton[1]), int(triton[2])) >= (3, 6), comment
    assert re.search(r"PyTorch \d+\.\d+", comment) and re.search(r"CUDA \d+\.\d+", comment)
    assert "assert v >= (3, 6)" in text  # and the build checks it


def test_what_the_image_copies_and_runs_exists():
    steps = instructions()
    assert ("COPY", "requirements.txt .") in steps and ("COPY", ". .") in steps
    (cmd,) = [rest for word, rest in steps if word == "CMD"]
    assert cmd == '["make", "train-small"]'
    assert re.search(r"^train-small:", read("Makefile"), re.M)
    ignored = read(".dockerignore").split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def test_torch_is_not_reinstalled_over_the_base():
    (run,) = [rest for word, rest in instructions() if word == "RUN" and "requirements" in rest]
    pattern = re.search(r"grep -v -E '([^']+)' requirements\.txt", run)[1]
    kept = [line for line in read("requirements.txt").splitlines() if line and not re.search(pattern, line)]
    names = [re.split(r"[<>=~! ]", line)[0] for line in kept if not line.startswith("#")]
    assert "torch" not in names and {"numpy", "triton", "tensorboard", "tqdm"} <= set(names), names
    assert "-r /tmp/requirements-without-torch.txt" in run


def test_the_chapters_docker_lines_match_the_image():
    text = read("chapters", "07-scaling.md")
    builds = re.findall(r"^\s*docker build -t (\S+) \.", text, re.M)
    assert builds, "the chapter builds the image"
    name = builds[0]
    runs = [line for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.strip().startswith("docker run ")]
    assert runs
    for line in runs:
        words = shlex.split(line)
        assert words[:5] == ["docker", "run", "--gpus", "all", "--ipc=host"], line
        assert any(w.startswith("--shm-size=") for w in words), line
        assert image_of(words) == name, line
    assert name in read("Dockerfile")  # the file's own usage lines say the same


def image_of(words):
    """The image of a `docker run` command: its first word that is neither an option nor an option's value."""
    takes_value = {"--gpus", "-v", "--volume", "-w", "--workdir", "-e", "--env", "--name", "--shm-size", "--ipc"}
    i = 2
    while words[i].startswith("-"):
        i += 2 if words[i] in takes_value else 1
    return words[i]
