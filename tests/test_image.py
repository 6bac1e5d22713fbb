"""The Dockerfile's contract, read from the file (no docker engine runs here): a CUDA torch by
default and another build by `--build-arg TORCH_SPEC`, the package installed from its wheel
without editable mode or test extras, a fixed non-root user that owns the checkpoint dir, the
agent as PID 1, and a .dockerignore that keeps the venv, git and test data out of the context.
scripts/check_image_install.sh performs the install steps themselves."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import REPO
from dockerfile import Stage, dockerignore_rules, dockerignored, exec_form, numeric_uid, parse_dockerfile

DOCKERFILE = REPO / "Dockerfile"


def final_stage() -> Stage:
    return parse_dockerfile(DOCKERFILE)[-1]


def pip_installs(stage: Stage) -> list[list[str]]:
    """The argument lists of every `pip install` in the stage's RUN instructions."""
    installs = []
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;", run.args):
            words = shlex.split(command)
            if "pip" in " ".join(words[:3]) and "install" in words:
                installs.append(words[words.index("install") + 1:])
    return installs


def test_torch_is_chosen_by_a_build_arg_that_defaults_to_pypis_cuda_build():
    stage = final_stage()
    args = dict(a.args.split("=", 1) for a in stage.all("ARG") if "=" in a.args)
    default = shlex.split(args["TORCH_SPEC"])
    # PyPI's Linux x86_64 torch wheel is the CUDA build; a CPU image names the CPU index instead.
    assert len(default) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", default[0]), default
    torch_installs = [words for words in pip_installs(stage) if "$TORCH_SPEC" in words]
    assert torch_installs, "no RUN installs $TORCH_SPEC (unquoted, so it may carry --index-url)"
    package_install = next(i for i, words in enumerate(pip_installs(stage)) if any("torchrevive" in w for w in words))
    assert pip_installs(stage).index(torch_installs[0]) < package_install, "torch must be installed before the package"


def test_the_package_is_installed_from_its_wheel_not_editable_and_without_test_extras():
    stages = parse_dockerfile(DOCKERFILE)
    for stage in stages:
        for words in pip_installs(stage):
            assert "-e" not in words and "--editable" not in words, words
            assert not any(re.search(r"\[[^]]*\b(dev|test)\b", w) for w in words), f"test extras installed: {words}"
    wheel_builds = [r.args for s in stages[:-1] for r in s.all("RUN") if "pip wheel" in r.args]
    assert wheel_builds and "--no-deps" in wheel_builds[0], "a build stage makes the wheel"
    (package,) = [w for words in pip_installs(final_stage()) for w in words if "torchrevive-" in w]
    assert package.endswith(".whl)[etcd]"), f"installs {package}: the wheel with the etcd extra (the etcd3 backend)"
    assert not any("setup.sh" in r.args for s in stages for r in s.all("RUN")), "setup.sh makes an editable dev venv"


def test_the_image_runs_as_a_fixed_non_root_user_who_owns_the_checkpoint_dir():
    stage = final_stage()
    uid = numeric_uid(stage)
    assert uid >= 1000
    keywords = [i.keyword for i in stage.instructions]
    assert keywords.index("ENTRYPOINT") > max(i for i, k in enumerate(keywords) if k == "USER")
    assert "RUN" not in keywords[max(i for i, k in enumerate(keywords) if k == "USER"):], "RUNs after USER lack root"
    runs = " ".join(r.args for r in stage.all("RUN"))
    assert f"useradd --uid {uid}" in runs
    assert re.search(rf"chown {uid}:\d+ /checkpoints\b", runs), "the image's user must be able to write /checkpoints"


def test_the_agent_is_pid_1_through_an_exec_form_entrypoint():
    stage = final_stage()
    (entrypoint,) = stage.all("ENTRYPOINT")
    assert exec_form(entrypoint.args) == ["torchrevive"], entrypoint.args
    assert exec_form(stage.all("CMD")[-1].args) is not None


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_heavy():
    rules = dockerignore_rules(REPO / ".dockerignore")
    copied = [word for s in parse_dockerfile(DOCKERFILE) for c in s.all("COPY") if not c.args.startswith("--from")
              for word in c.args.split()[:-1]]
    assert {"pyproject.toml", "README.md", "agent", "launcher", "examples"} <= set(copied)
    for path in [*copied, "agent/checkpoint/write.py", "examples/train.py"]:
        assert not dockerignored(path, rules), f"{path} is copied by the Dockerfile but excluded by .dockerignore"
    for path in [".venv/bin/python", ".venv-peers/bin/python", ".git/HEAD",
                 "tests/data/k8s_schemas/kubeflow.org_pytorchjobs.yaml",
                 "docs/results/x.json", "checkpoints/step_1", "agent/__pycache__/config.cpython-311.pyc",
                 "torchrevive.egg-info/PKG-INFO", ".pytest_cache/v"]:
        assert dockerignored(path, rules), f"{path} would be sent to the docker build context"


@pytest.mark.parametrize("rules, path, ignored", [
    (["*", "!agent"], "agent/config.py", False),
    (["*", "!agent"], ".venv/bin/python", True),
    (["*", "!agent", "**/__pycache__"], "agent/__pycache__/a.pyc", True),
    ([".git"], ".gitignore", False),
])
def test_dockerignore_rules_follow_dockers_last_match(rules, path, ignored):
    assert dockerignored(path, rules) is ignored
