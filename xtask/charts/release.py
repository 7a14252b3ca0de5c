"""Installs, upgrades and uninstalls flatnet's charts on a cluster with the
real Helm library (PyPI `helm-python-sdk`, Helm 4), as a user's `helm`
command would: `cargo xtask e2e` drives the release on the real-cluster
tier with it. Runs in the virtualenv of `cargo xtask charts`.

    release.py --kubeconfig K install CHART NAME NAMESPACE [--set k=v ...]
    release.py --kubeconfig K upgrade CHART NAME NAMESPACE [--set k=v ...]
    release.py --kubeconfig K uninstall NAME NAMESPACE
    release.py --kubeconfig K status NAME NAMESPACE

Prints the release's name, revision and status; exits non-zero with Helm's
message when Helm fails.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import helm_python as helm

# Long enough for a first start on a 2-core machine; Helm fails the
# release when its objects are not ready by then.
TIMEOUT_SECONDS = 300


def values_from(sets: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for expression in sets:
        merge(values, helm.parse_set_string(expression))
    return values


def merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def describe(release: dict[str, Any]) -> str:
    info = release.get("info", {})
    return f"{release.get('name')} revision {release.get('version')}: {info.get('status')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "upgrade"):
        command = commands.add_parser(name)
        command.add_argument("chart")
        command.add_argument("name")
        command.add_argument("namespace")
        command.add_argument("--set", action="append", default=[], dest="sets")
    for name in ("uninstall", "status"):
        command = commands.add_parser(name)
        command.add_argument("name")
        command.add_argument("namespace")
    args = parser.parse_args()

    try:
        with helm.Config(kubeconfig_path=args.kubeconfig, namespace=args.namespace) as config:
            if args.command == "install":
                release = config.install(
                    args.chart,
                    args.name,
                    values_from(args.sets),
                    namespace=args.namespace,
                    create_namespace=True,
                    wait="watcher",
                    timeout=TIMEOUT_SECONDS,
                )
            elif args.command == "upgrade":
                release = config.upgrade(
                    args.chart,
                    args.name,
                    values_from(args.sets),
                    namespace=args.namespace,
                    wait="watcher",
                    timeout=TIMEOUT_SECONDS,
                )
            elif args.command == "uninstall":
                release = config.uninstall(
                    args.name, wait="watcher", timeout=TIMEOUT_SECONDS
                ).get("release", {})
            else:
                release = config.status(args.name)
    except helm.HelmError as err:
        print(f"helm {args.command} {args.name}: {err}", file=sys.stderr)
        return 1
    print(describe(release))
    return 0


if __name__ == "__main__":
    sys.exit(main())
