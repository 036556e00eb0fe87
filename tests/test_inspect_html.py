"""The HTML report renders in headless Chromium: screenshot taken, title and collective table present.

Needs the ``chromium`` binary (Debian's package; .ci/run installs it): skipped only
where it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dpar.explaining import explain
from dpar.inspect.render_html import write_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1200,1600"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = explain(model, (torch.randn(4, 16),), world_size=8, options={"bucket_cap_mb": 500 / 2**20})
    page = write_html(report, tmp_path / "report.html")

    shot = tmp_path / "shot.png"
    done = chromium(f"--screenshot={shot}", page.as_uri(), profile=tmp_path / "profile-shot")
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000

    dom = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").stdout
    assert "<title>dpar report: Sequential, ddp on 8 ranks (h100)</title>" in dom
    assert '<h2 id="collectives">Collectives</h2>' in dom
    assert "<td>all_reduce_default_1</td>" in dom and "<td>2,176</td>" in dom
    assert '<img class="timeline"' in dom
