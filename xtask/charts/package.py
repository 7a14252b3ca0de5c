#!/usr/bin/env python3
"""Packages flatnet's Helm charts with the real Helm library.

Run by `cargo xtask release` inside the virtualenv of requirements.txt.
Every chart under `charts/` becomes `<name>-<version>.tgz` in the
destination; each package is then loaded back and must carry the chart's
name, version and appVersion.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import helm_python as helm
import yaml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, required=True, help="workspace root")
    parser.add_argument("--destination", type=pathlib.Path, required=True, help="directory for the .tgz files")
    args = parser.parse_args()
    failures = 0
    for chart_dir in sorted((args.root / "charts").iterdir()):
        chart_yaml = chart_dir / "Chart.yaml"
        if not chart_yaml.exists():
            continue
        meta = yaml.safe_load(chart_yaml.read_text())
        path = pathlib.Path(helm.package(str(chart_dir), destination=str(args.destination)))
        expected = args.destination / f"{meta['name']}-{meta['version']}.tgz"
        with helm.Chart.load(str(path)) as loaded:
            got = loaded.metadata
            ok = (
                path == expected
                and loaded.name == meta["name"]
                and got.get("version") == meta["version"]
                and (got.get("appVersion") or got.get("app_version")) == meta["appVersion"]
            )
        print(f"{'packaged' if ok else 'FAILED'} {path.name}: {meta['name']} {meta['version']} (app {meta['appVersion']})")
        failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
