"""The setup's pins against the package registry: what the README's first command resolves on a machine that reaches
only the registry (no local wheel folder, no pip configuration). Needs the network, so it skips, saying why, where
the registry cannot be reached; scripts/check_fresh_install.sh runs the whole install."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _registry_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_CACHE_DIR=str(tmp_path / "cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _project_requirement(name: str) -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (req,) = [d for d in deps if re.match(rf"{name}\b", d)]
    return req.split(";")[0].strip()


def _resolve(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(tmp_path / "report.json"), *args]
    return subprocess.run(cmd, env=_registry_env(tmp_path), capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # 19 s of network: the suite's budget; .ci/run's own install resolves the same pins from the registry
def test_setup_pins_resolve_from_the_registry_alone(tmp_path):
    """torch's registry build pins its own triton: the constraints setup.sh always applies must not contradict it."""
    if sys.platform != "linux":
        pytest.skip("the pins are checked for Linux, where the project depends on triton")
    res = _resolve(tmp_path, "-c", os.path.join(ROOT, "scripts", "constraints.txt"), "torch",
                   _project_requirement("triton"), _project_requirement("transformers"))
    if res.returncode != 0 and "ResolutionImpossible" not in res.stderr and "conflict" not in res.stderr:
        pytest.skip(f"the package registry could not be reached: {res.stderr.strip()[-300:]}")
    assert res.returncode == 0, res.stderr
    with open(tmp_path / "report.json") as f:
        got = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.load(f)["install"]}
    pins = dict(line.split("==") for line in open(os.path.join(ROOT, "scripts", "constraints.txt"))
                if "==" in line and not line.startswith("#"))
    assert got["torch"] == pins["torch"].strip() and got["transformers"] == pins["transformers"].strip()
    assert "triton" in got


def test_setup_script_pins_triton_only_for_a_torch_without_its_own(tmp_path):
    """The decision setup.sh makes, run on two fake torch distributions' requirement lists."""
    script = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    probe = re.search(r"<<'PY'\n(.*?)\nPY", script, re.S)
    assert probe is not None, "setup.sh no longer asks torch whether it pins triton"
    code = probe.group(1).replace('md.requires("torch")', "REQS")
    for reqs, pins_its_own in ((["filelock", "triton==3.7.1; platform_system == 'Linux'"], True),
                               (["filelock", "sympy>=1.13.3"], False)):
        res = subprocess.run([sys.executable, "-c", f"REQS = {reqs!r}\n{code}"], capture_output=True)
        assert (res.returncode == 0) is pins_its_own, (reqs, res.stderr)
