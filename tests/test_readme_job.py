"""The README's Ray job recipe, run as it stands (issue 47 item 8).

The block between the README's job-recipe markers is run line for line by bash, in a fresh
folder and a fresh home (no Ray token yet, as on a new machine), with `.venv` there pointing at
the environment megaray is installed in: it starts a real head with `ray start` (token
authentication on), submits the demo as a job, waits for it and stops the head. The run it
leaves is read back from its run directory.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _recipe() -> str:
    text = README.read_text()
    block = re.search(r"<!-- job recipe[^>]*-->\s*```bash\n(.*?)```\s*<!-- end of the job recipe -->", text, re.S)
    assert block, "the README's job recipe (between its markers) is gone"
    return block.group(1)


def test_the_readme_job_recipe_runs_verbatim(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.symlink(Path(sys.prefix), tmp_path / ".venv")          # `. .venv/bin/activate` where the user stands
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}    # as a fresh shell has it
    env.update(HOME=str(home))
    p = subprocess.run(["bash", "-e", "-c", _recipe()], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    out = p.stdout + p.stderr
    try:
        assert p.returncode == 0, out[-5000:]
        assert (home / ".ray" / "auth_token").is_file()                 # the head ran with a token
        assert "Job 'megaray-demo' succeeded" in out, out[-5000:]
        (summary,) = [json.loads(f.read_text()) for f in (tmp_path / "runs").glob("demo-*/summary.json")]
        assert summary["status"] == "succeeded" and summary["steps"] == 50
        assert "finished: steps 1..50" in out
    finally:
        subprocess.run([str(Path(sys.prefix) / "bin" / "ray"), "stop", "--force"], env=env, capture_output=True,
                       timeout=120)
