#!/usr/bin/env python3
"""Checks flatnet's Helm charts with the real Helm library.

Run by `cargo xtask charts` inside a virtualenv holding requirements.txt.
For each chart and each values set (the defaults, then every
`ci/*-values.yaml` of the chart) it:

1. lints the chart (strict: warnings fail) for Kubernetes 1.28;
2. validates the values against values.schema.json, and checks that the
   schema rejects values it must reject;
3. renders the templates and validates every object against the
   Kubernetes 1.28 OpenAPI schema (strict: unknown fields fail);
4. checks what a schema cannot: least-privilege RBAC, the security
   contexts, Bidirectional mounts only in privileged containers, and that
   the values reach the objects;
5. checks that every environment variable and subcommand the chart gives a
   flatnet component is one the component documents (docs/<component>.md)
   or defines (its clap `env = "..."` attributes);
6. checks every flatnet container against the binaries themselves
   (`--binaries`): the image is the one `cargo xtask images` builds, the
   command is a subcommand the binary has, every flag and environment
   variable is one that subcommand accepts (read from the clap-generated
   `-h` output, so a renamed flag fails here) and every value of a variable
   with a fixed set of values is one of them.

With `--dump FILE`, the objects rendered from the flatnet chart's default
values are also written to FILE (JSON), for the image tests that run the
chart's containers under podman.

Every problem is collected and printed; the exit status is 1 if any was found.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import re
import subprocess
import sys
from typing import Any, Iterator

import helm_python as helm
import jsonschema
import jsonschema.exceptions
import kubernetes_validate
import yaml

KUBE_VERSION = "1.28.0"
NAMESPACE = "cattle-flat-network"
RELEASE = "flatnet"

# Environment variables the chart sets although the component neither
# documents nor defines them yet, with the reason the chart sets them.
# Each is reported as UNVERIFIED on every run. Once the component documents
# one, the check fails until the entry is removed here, so this list only
# ever shrinks.
PENDING_ENV: dict[str, dict[str, str]] = {}

# Subcommands the chart runs that are not documented yet; same rules.
PENDING_COMMANDS: dict[str, dict[str, str]] = {}

# Which flatnet component each workload runs: (kind, name suffix) -> component.
COMPONENTS = {
    ("Deployment", "-operator"): "operator",
    ("DaemonSet", "-agent"): "agent",
}

# The only containers allowed to run privileged, and why.
PRIVILEGED_ALLOWED = {
    ("agent", "mount-bpffs"): "Bidirectional mount propagation of bpffs",
    ("multus", "install-multus-binary"): "Multus's own manifests",
    ("multus", "multus"): "Multus's own manifests",
}

# Capabilities the agent may add; each is explained in the DaemonSet.
AGENT_CAPABILITIES = {"NET_ADMIN", "NET_RAW", "BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"}

# Values the schema must refuse: (description, path, bad value).
SCHEMA_REJECTS = [
    ("unknown arpPolicy", ["arpPolicy"], "proxy"),
    ("unknown failurePolicy", ["operator", "webhook", "failurePolicy"], "Never"),
    ("string replicas", ["operator", "replicas"], "2"),
    ("unknown top-level key", ["arpPolicies"], "arping"),
    ("unknown multus CNI version", ["multus", "cni", "version"], "0.2.0"),
    ("relative host path", ["agent", "hostPaths", "state"], "var/lib/flatnet"),
    ("not a Go duration", ["operator", "election", "leaseDuration"], "45"),
    ("not a CIDR list", ["clusterCIDR"], "10.42.0.0"),
    ("unknown legacy clusterType", ["clusterType"], "RKE1"),
    ("legacy resync period that is not minutes", ["flatNetworkOperator", "cattleResyncDefault"], "1h"),
    ("unknown legacy operator key", ["flatNetworkOperator", "replica"], 2),
]


class Problems:
    """Collects every problem so one run reports all of them."""

    def __init__(self, verbose: bool = True) -> None:
        self.items: list[str] = []
        self.verbose = verbose

    @classmethod
    def quiet(cls) -> "Problems":
        """Collects without printing (for checks expected to find something)."""
        return cls(verbose=False)

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}")
        if self.verbose:
            print(f"  FAIL {where}: {message}")

    def check(self, condition: bool, where: str, message: str) -> None:
        if not condition:
            self.add(where, message)


def set_path(values: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj.get("kind") in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers") or []
    yield from spec.get("containers") or []


def component_of(obj: dict[str, Any]) -> str | None:
    labels = obj.get("metadata", {}).get("labels", {})
    return labels.get("app.kubernetes.io/component")


# --- documentation of the components ---------------------------------------


class Documented:
    """Environment variables and commands each component documents or defines."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.reported: set[str] = set()
        self.env: dict[str, set[str]] = {}
        self.text: dict[str, str] = {}
        for component in ("operator", "agent"):
            doc = root / "docs" / f"{component}.md"
            text = doc.read_text() if doc.exists() else ""
            if not text:
                print(f"  note: {doc.relative_to(root)} does not exist yet")
            crate = root / f"flatnet-{component}" / "src"
            sources = "\n".join(p.read_text() for p in sorted(crate.rglob("*.rs")))
            names = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", text))
            names |= set(re.findall(r'\benv\s*=\s*"([A-Z][A-Z0-9_]*)"', sources))
            self.env[component] = names
            # Commands count as documented in the component's doc or the README.
            self.text[component] = text + (root / "README.md").read_text()

    def unverified(self, message: str) -> None:
        """Reports a pending name once per run."""
        if message not in self.reported:
            self.reported.add(message)
            print(f"  UNVERIFIED {message}")

    def check_env(self, component: str, name: str, where: str, problems: Problems) -> None:
        pending = PENDING_ENV.get(component, {})
        if name in self.env[component]:
            problems.check(
                name not in pending,
                where,
                f"{name} is now documented by the {component}: remove it from PENDING_ENV",
            )
        elif name in pending:
            self.unverified(f"{name} ({pending[name]}) is not documented by the {component} yet")
        else:
            problems.add(
                where,
                f"{name} is neither documented in docs/{component}.md nor an env of "
                f"flatnet-{component}'s command line: fix the name or document it",
            )

    def check_command(self, component: str, command: list[str], where: str, problems: Problems) -> None:
        line = " ".join(command)
        pending = PENDING_COMMANDS.get(component, {})
        if line in self.text[component]:
            problems.check(
                line not in pending,
                where,
                f"`{line}` is now documented: remove it from PENDING_COMMANDS",
            )
        elif line in pending:
            self.unverified(f"`{line}` ({pending[line]}) is not documented by the {component} yet")
        else:
            problems.add(where, f"`{line}` is not a documented command of flatnet-{component}")


# --- checks on rendered objects --------------------------------------------


def check_rbac(obj: dict[str, Any], where: str, problems: Problems) -> None:
    kind = obj["kind"]
    if kind in ("ClusterRole", "Role"):
        for rule in obj.get("rules") or []:
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                problems.check(
                    "*" not in (rule.get(field) or []),
                    where,
                    f"wildcard in {field} of rule {rule}",
                )
        problems.check(not obj.get("aggregationRule"), where, "aggregated roles are not least privilege")
    if kind in ("ClusterRoleBinding", "RoleBinding"):
        role = obj["roleRef"]["name"]
        problems.check(
            role not in ("cluster-admin", "admin", "edit"),
            where,
            f"bound to the built-in role {role}",
        )


def check_pod_security(obj: dict[str, Any], where: str, problems: Problems) -> None:
    spec = pod_spec(obj)
    if spec is None:
        return
    component = component_of(obj)
    for container in containers(spec):
        here = f"{where} container {container['name']}"
        ctx = container.get("securityContext") or {}
        privileged = bool(ctx.get("privileged"))
        if privileged:
            problems.check(
                (component, container["name"]) in PRIVILEGED_ALLOWED,
                here,
                "runs privileged; grant specific capabilities instead",
            )
        for mount in container.get("volumeMounts") or []:
            if mount.get("mountPropagation") == "Bidirectional":
                # The API server rejects this for unprivileged containers.
                problems.check(
                    privileged,
                    here,
                    f"Bidirectional propagation on {mount['mountPath']} needs privileged: true",
                )
        if component == "operator":
            pod_ctx = spec.get("securityContext") or {}
            problems.check(pod_ctx.get("runAsNonRoot") is True, here, "operator pod must set runAsNonRoot")
            problems.check(ctx.get("readOnlyRootFilesystem") is True, here, "root filesystem must be read-only")
            problems.check(ctx.get("allowPrivilegeEscalation") is False, here, "privilege escalation must be off")
            caps = ctx.get("capabilities") or {}
            problems.check(caps.get("drop") == ["ALL"] and not caps.get("add"), here, "must drop ALL capabilities")
            probes = {
                "livenessProbe": "/healthz",
                "readinessProbe": "/readyz",
            }
            for probe, path in probes.items():
                got = ((container.get(probe) or {}).get("httpGet") or {}).get("path")
                problems.check(got == path, here, f"{probe} must GET {path}, got {got}")
        if component == "agent" and container["name"] == "agent":
            caps = ctx.get("capabilities") or {}
            problems.check(not privileged, here, "the agent container must not be privileged")
            problems.check(caps.get("drop") == ["ALL"], here, "must drop ALL capabilities")
            extra = set(caps.get("add") or []) - AGENT_CAPABILITIES
            problems.check(not extra, here, f"unexpected capabilities {sorted(extra)}")
            problems.check(ctx.get("readOnlyRootFilesystem") is True, here, "root filesystem must be read-only")


def check_env_and_commands(obj: dict[str, Any], where: str, docs: Documented, problems: Problems) -> None:
    spec = pod_spec(obj)
    if spec is None:
        return
    component = next(
        (c for (kind, suffix), c in COMPONENTS.items() if obj["kind"] == kind and obj["metadata"]["name"].endswith(suffix)),
        None,
    )
    if component is None:
        return
    for container in containers(spec):
        here = f"{where} container {container['name']}"
        for env in container.get("env") or []:
            docs.check_env(component, env["name"], here, problems)
        command = (container.get("command") or []) + (container.get("args") or [])
        if command:
            words = [w for w in command if not w.startswith("-")]
            docs.check_command(component, words, here, problems)


def env_of(obj: dict[str, Any], container_name: str) -> dict[str, str]:
    spec = pod_spec(obj) or {}
    for container in containers(spec):
        if container["name"] == container_name:
            return {e["name"]: e.get("value") for e in container.get("env") or []}
    return {}


def check_values_reach_objects(
    objects: dict[tuple[str, str], dict[str, Any]],
    values: dict[str, Any],
    app_version: str,
    where: str,
    problems: Problems,
) -> None:
    """The values the chart was rendered with show up where they belong."""

    def find(kind: str, component: str) -> dict[str, Any] | None:
        return next(
            (o for (k, _), o in objects.items() if k == kind and component_of(o) == component),
            None,
        )

    def image(spec: dict[str, Any]) -> str:
        registry = values["global"]["imageRegistry"].rstrip("/")
        ref = f"{spec['repository']}:{spec['tag'] or app_version}"
        return f"{registry}/{ref}" if registry else ref

    operator = find("Deployment", "operator")
    agent = find("DaemonSet", "agent")
    if operator is None or agent is None:
        problems.add(where, "the operator Deployment and the agent DaemonSet must be rendered")
        return
    op = values["operator"]
    problems.check(operator["spec"]["replicas"] == op["replicas"], where, "operator replicas")
    op_image = operator["spec"]["template"]["spec"]["containers"][0]["image"]
    problems.check(op_image == image(op["image"]), where, f"operator image {op_image} != {image(op['image'])}")
    ag_image = agent["spec"]["template"]["spec"]["containers"][0]["image"]
    problems.check(
        ag_image == image(values["agent"]["image"]),
        where,
        f"agent image {ag_image} != {image(values['agent']['image'])}",
    )
    env = env_of(operator, "operator")
    expected = {
        "FLAT_NETWORK_CLUSTER_CIDR": values["clusterCIDR"],
        "FLAT_NETWORK_SERVICE_CIDR": values["serviceCIDR"],
        "FLAT_NETWORK_CNI_ARP_POLICY": values["arpPolicy"],
        "FLAT_NETWORK_CNI_PROXY_ARP": str(values["proxyARP"]).lower(),
        "FLATNET_NETWORK_ATTACHMENT": values["networkAttachment"],
        "CATTLE_DEV_MODE": op["cattleDevMode"],
        "CATTLE_RESYNC_DEFAULT": str(op["cattleResyncDefault"]),
        "CATTLE_ELECTION_LEASE_DURATION": op["election"]["leaseDuration"],
        "CATTLE_ELECTION_RENEW_DEADLINE": op["election"]["renewDeadline"],
        "CATTLE_ELECTION_RETRY_PERIOD": op["election"]["retryPeriod"],
        "FLATNET_LEASE_NAME": op["election"]["leaseName"],
        "FLATNET_LOG_FORMAT": op["logFormat"],
        "FLATNET_ADMIN_ADDRESS": f"0.0.0.0:{op['adminPort']}",
        "FLATNET_WEBHOOK_BIND_ADDRESS": "0.0.0.0",
        "FLATNET_WEBHOOK_PORT": str(op["webhook"]["port"]),
    }
    for name, value in expected.items():
        problems.check(env.get(name) == value, where, f"operator {name}={env.get(name)!r}, expected {value!r}")
    ag = values["agent"]
    agent_env = env_of(agent, "agent")
    for name, value in {
        "FLATNET_LOG": ag["logLevel"],
        "FLATNET_LOG_FORMAT": ag["logFormat"],
        "FLATNET_BPF_PIN_ROOT": ag["bpfPinRoot"],
        "FLATNET_AGENT_SOCKET": ag["socket"],
        "FLATNET_STATE_DIR": ag["hostPaths"]["state"],
        "FLATNET_CNI_BIN_DIR": ag["hostPaths"]["cniBin"],
        "FLAT_NETWORK_CNI_ARP_POLICY": values["arpPolicy"],
        "FLAT_NETWORK_CNI_PROXY_ARP": str(values["proxyARP"]).lower(),
    }.items():
        problems.check(agent_env.get(name) == value, where, f"agent {name}={agent_env.get(name)!r}, expected {value!r}")
    agent_spec = agent["spec"]["template"]["spec"]
    problems.check(agent_spec.get("hostNetwork") is True, where, "the agent needs hostNetwork")
    problems.check(agent_spec.get("hostPID") == ag["hostPID"], where, "agent hostPID follows agent.hostPID")
    problems.check(
        {"operator": "Exists"} in (agent_spec.get("tolerations") or []),
        where,
        "the agent must tolerate every taint",
    )
    init_names = [c["name"] for c in agent_spec.get("initContainers") or []]
    problems.check(("mount-bpffs" in init_names) == ag["mountBpffs"], where, "mount-bpffs follows agent.mountBpffs")

    webhook = find("ValidatingWebhookConfiguration", "operator")
    if webhook is None:
        problems.add(where, "no ValidatingWebhookConfiguration rendered")
    else:
        for hook in webhook["webhooks"]:
            problems.check(
                hook["failurePolicy"] == op["webhook"]["failurePolicy"],
                where,
                f"webhook {hook['name']} failurePolicy {hook['failurePolicy']}",
            )
            problems.check("caBundle" not in hook["clientConfig"], where, "caBundle is the operator's, not the chart's")
    pdb = find("PodDisruptionBudget", "operator")
    problems.check((pdb is not None) == op["podDisruptionBudget"]["enabled"], where, "PDB follows its value")
    multus = find("DaemonSet", "multus")
    problems.check((multus is not None) == values["multus"]["enabled"], where, "Multus DaemonSet follows multus.enabled")
    if multus is not None:
        multus_image = multus["spec"]["template"]["spec"]["containers"][0]["image"]
        problems.check(multus_image == image(values["multus"]["image"]), where, f"multus image {multus_image}")
        args = multus["spec"]["template"]["spec"]["containers"][0]["args"]
        problems.check(
            f"--cni-version={values['multus']['cni']['version']}" in args,
            where,
            "multus --cni-version follows multus.cni.version",
        )


# --- the binaries' command lines ------------------------------------------


class CliSurface:
    """What a binary accepts, read from clap's `-h` output of every subcommand.

    `commands` maps a subcommand path (`("run",)`, `()` for the binary
    itself) to its flags: `--name` -> (environment variable or None,
    allowed values or None).
    """

    OPTION = re.compile(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)(.*)$")
    ENV = re.compile(r"\[env: ([A-Za-z_][A-Za-z0-9_]*)=")
    VALUES = re.compile(r"\[possible values: ([^\]]+)\]")

    def __init__(self, binary: pathlib.Path) -> None:
        self.binary = binary
        self.commands: dict[tuple[str, ...], dict[str, tuple[str | None, list[str] | None]]] = {}
        self._crawl(())

    def _help(self, path: tuple[str, ...]) -> str:
        # An empty environment: clap prints the current value of each env
        # variable, which must not leak into what is compared.
        result = subprocess.run(
            [str(self.binary), *path, "-h"], capture_output=True, text=True, env={}, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"{self.binary.name} {' '.join(path)} -h failed: {result.stderr}")
        return result.stdout

    def _crawl(self, path: tuple[str, ...]) -> None:
        text = self._help(path)
        # Each option's text: its own line and, when clap puts the help on
        # the next lines (long descriptions), the lines up to the next option.
        options: list[tuple[str, str]] = []
        section = None
        subcommands = []
        for line in text.splitlines():
            if line and not line[0].isspace():
                section = line.rstrip(":")
                continue
            if section == "Commands":
                words = line.split()
                if words and words[0] != "help":
                    subcommands.append(words[0])
                continue
            match = self.OPTION.match(line)
            if match:
                options.append((match.group(1), match.group(2)))
            elif options and line.strip():
                options[-1] = (options[-1][0], options[-1][1] + " " + line.strip())
        flags: dict[str, tuple[str | None, list[str] | None]] = {}
        for flag, described in options:
            env = self.ENV.search(described)
            values = self.VALUES.search(described)
            flags[flag] = (
                env.group(1) if env else None,
                [v.strip() for v in values.group(1).split(",")] if values else None,
            )
        self.commands[path] = flags
        for sub in subcommands:
            self._crawl((*path, sub))

    def split(self, words: list[str]) -> tuple[tuple[str, ...], list[str]]:
        """The longest known subcommand path at the start of `words`, and the rest."""
        path: tuple[str, ...] = ()
        rest = list(words)
        while rest and (*path, rest[0]) in self.commands:
            path = (*path, rest.pop(0))
        return path, rest

    def accepted(self, path: tuple[str, ...]) -> dict[str, tuple[str | None, list[str] | None]]:
        """Flags of the subcommand and of its parents (clap's global flags)."""
        flags: dict[str, tuple[str | None, list[str] | None]] = {}
        for depth in range(len(path) + 1):
            flags.update(self.commands.get(path[:depth], {}))
        return flags


def check_against_binaries(
    obj: dict[str, Any],
    where: str,
    clis: dict[str, CliSurface],
    images: dict[str, str] | None,
    problems: Problems,
) -> None:
    """The chart's containers run what the built images and binaries accept.

    `images`: the references the default values must render (None for
    values that name other images on purpose)."""
    spec = pod_spec(obj)
    if spec is None:
        return
    component = component_of(obj)
    if component not in clis:
        return
    for container in containers(spec):
        here = f"{where} container {container['name']}"
        if images is not None:
            problems.check(
                container["image"] == images[component],
                here,
                f"image {container['image']} is not the image `cargo xtask images` builds ({images[component]})",
            )
        words = (container.get("command") or []) + (container.get("args") or [])
        # No command: the image's own, the component's binary.
        binary = f"flatnet-{component}"
        if words and words[0] != binary:
            problems.add(here, f"runs {words[0]!r}, not {binary}")
            continue
        cli = clis[component]
        path, rest = cli.split(words[1:])
        flags = cli.accepted(path)
        line = " ".join([binary, *path])
        for word in rest:
            flag = word.split("=", 1)[0]
            if word.startswith("--"):
                problems.check(flag in flags, here, f"`{line}` has no flag {flag}")
            else:
                problems.add(here, f"`{line}` has no subcommand {word!r}")
        by_env = {env: values for env, values in flags.values() if env}
        for env in container.get("env") or []:
            name = env["name"]
            if name not in by_env:
                problems.add(here, f"`{line}` reads no environment variable {name} (not in its -h output)")
                continue
            allowed = by_env[name]
            value = env.get("value")
            if allowed is not None and value is not None:
                problems.check(
                    value in allowed,
                    here,
                    f"{name}={value!r} is not one of the values `{line}` accepts: {', '.join(allowed)}",
                )


# Changes to a rendered container the binary check must refuse: (description,
# component, change). Each proves that a renamed flag or variable fails here.
CLI_REJECTS = [
    ("a renamed environment variable", "agent", lambda c: c["env"].append({"name": "FLATNET_TC_ATTACHED", "value": "auto"})),
    ("an unknown value of a fixed-set variable", "agent", lambda c: c["env"].append({"name": "FLATNET_LOG_FORMAT", "value": "xml"})),
    ("an unknown subcommand", "agent", lambda c: c.__setitem__("command", ["flatnet-agent", "serve"])),
    ("an unknown flag", "agent", lambda c: c.__setitem__("args", ["--socket-path=/run/x"])),
    ("a renamed operator variable", "operator", lambda c: c["env"].append({"name": "FLATNET_WEBHOOK_PORTS", "value": "1"})),
    ("another image", "operator", lambda c: c.__setitem__("image", "flatnet/flatnet-operator:latest")),
]


def check_cli_rejects(
    objects: dict[tuple[str, str], dict[str, Any]],
    clis: dict[str, CliSurface],
    images: dict[str, str],
    problems: Problems,
) -> None:
    """Each entry of CLI_REJECTS, applied to the default render, is reported."""
    for description, component, change in CLI_REJECTS:
        workload = next(o for o in objects.values() if pod_spec(o) is not None and component_of(o) == component)
        mutated = copy.deepcopy(workload)
        change(pod_spec(mutated)["containers"][0])
        found = Problems.quiet()
        check_against_binaries(mutated, "mutation", clis, images, found)
        problems.check(bool(found.items), f"binary check [{description}]", "was not reported")


# --- driving ----------------------------------------------------------------


def render_objects(
    chart: Any, values: dict[str, Any] | None, where: str, problems: Problems
) -> dict[tuple[str, str], dict[str, Any]]:
    try:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as err:
        problems.add(where, f"render failed: {err}")
        return {}
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            problems.check(bool(text.strip()), f"{where} {path}", "NOTES.txt renders empty")
            continue
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            key = (doc.get("kind"), name)
            problems.check(key not in objects, f"{where} {path}", f"{name} rendered twice")
            objects[key] = doc
    return objects


# rancher-flat-network values file and the NOTES.txt lines it must produce
# (charts/flatnet/ci/legacy/); its objects must equal those of the mapped
# values file beside it.
LEGACY_VALUES = "ci/legacy/original-values.yaml"
LEGACY_MAPPED = "ci/legacy-mapped-values.yaml"
LEGACY_NOTES = [
    "flatNetworkOperator.replicas -> operator.replicas",
    "flatNetworkOperator.cattleResyncDefault -> operator.cattleResyncDefault",
    "flatNetworkOperator.cattleDevMode -> operator.cattleDevMode",
    "flatNetworkOperator.limits -> operator.resources.limits",
    "flatNetworkOperator.image: ignored",
    "flatNetworkCNI.image: ignored",
    "clusterType: K3s -> agent.hostPaths.cniBin/cniConf (the k3s paths)",
    "global.cattle.systemDefaultRegistry -> global.imageRegistry",
    "deploy.*: ignored",
]


def check_legacy_values(chart: Any, chart_dir: pathlib.Path, problems: Problems) -> None:
    """An upgrading user's rancher-flat-network values file renders exactly
    what flatnet's names for the same settings render, and NOTES.txt names
    each legacy key; the default values name none."""
    where = f"{chart_dir.name} [{LEGACY_VALUES}]"
    print(f"==> {where}")
    legacy = yaml.safe_load((chart_dir / LEGACY_VALUES).read_text())
    mapped = yaml.safe_load((chart_dir / LEGACY_MAPPED).read_text())
    try:
        chart.validate_schema(legacy)
    except helm.HelmError as err:
        problems.add(where, f"values.schema.json refuses the legacy values: {err}")
    got = render_objects(chart, legacy, where, problems)
    want = render_objects(chart, mapped, f"{chart_dir.name} [{LEGACY_MAPPED}]", problems)
    for key in sorted(set(got) | set(want)):
        problems.check(got.get(key) == want.get(key), where, f"{key[1]} differs from the mapped values' render")

    def notes(values: dict[str, Any] | None) -> str:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))

    legacy_notes = notes(legacy)
    for line in LEGACY_NOTES:
        problems.check(line in legacy_notes, where, f"NOTES.txt does not say {line!r}")
    problems.check("DEPRECATED" not in notes(None), f"{chart_dir.name} [default values]", "NOTES.txt names legacy keys")
    problems.check("DEPRECATED" not in notes(mapped), where, "NOTES.txt names legacy keys for flatnet's names")


class CustomResources:
    """The schemas of flatnet's own kinds, from the CRD chart: objects of
    these kinds (the FlatNetworkConfig the chart creates) are validated
    against them, as strictly as the built-in kinds (unknown fields fail)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.schemas: dict[tuple[str, str], dict[str, Any]] = {}
        crds = root / "charts" / "flatnet-crd" / "templates" / "crds.yaml"
        for crd in yaml.safe_load_all(crds.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                schema.setdefault("properties", {}).update(
                    {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
                )
                self.schemas[(f"{group}/{version['name']}", kind)] = strict(schema)

    def validate(self, obj: dict[str, Any]) -> str | None:
        """None when `obj` is not of a flatnet kind or is valid; else the problem."""
        schema = self.schemas.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        if schema is None:
            return None
        error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(obj))
        if error is None:
            return None
        path = ".".join(str(p) for p in error.path)
        return f"invalid for its CRD at {path}: {error.message}"


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with unknown fields refused wherever it lists the fields and
    keeps no unknown ones (as the API server's strict field validation)."""
    for value in schema.values():
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, dict):
                strict(child)
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    return schema


def validate_objects(
    objects: dict[tuple[str, str], dict[str, Any]], where: str, crds: CustomResources, problems: Problems
) -> None:
    for (_, name), obj in objects.items():
        if obj.get("apiVersion", "").startswith("flatnetwork.pandaria.io/"):
            problem = crds.validate(obj)
            problems.check(
                (obj.get("apiVersion"), obj.get("kind")) in crds.schemas,
                f"{where} {name}",
                "no CRD in charts/flatnet-crd for this kind",
            )
            if problem:
                problems.add(f"{where} {name}", problem)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            problems.add(f"{where} {name}", f"invalid for Kubernetes {KUBE_VERSION} at {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            problems.add(f"{where} {name}", err.message)


def check_chart(
    chart_dir: pathlib.Path,
    docs: Documented,
    clis: dict[str, CliSurface],
    images: dict[str, str],
    dump: pathlib.Path | None,
    problems: Problems,
) -> tuple[int, int]:
    """Checks one chart with each of its values sets; returns how many passed and failed."""
    value_sets: list[tuple[str, dict[str, Any] | None]] = [("default values", None)]
    for path in sorted((chart_dir / "ci").glob("*-values.yaml")):
        value_sets.append((f"{path.relative_to(chart_dir)}", yaml.safe_load(path.read_text())))
    passed = failed = 0
    with helm.Chart.load(str(chart_dir)) as chart:
        defaults = chart.values
        app_version = chart.metadata.get("appVersion") or chart.metadata.get("app_version") or ""
        for label, values in value_sets:
            before = len(problems.items)
            where = f"{chart_dir.name} [{label}]"
            print(f"==> {where}")
            report = helm.lint(
                str(chart_dir),
                values,
                strict=True,
                namespace=NAMESPACE,
                kube_version=f"v{KUBE_VERSION}",
            )
            for message in report.get("messages", []):
                line = f"lint {message.get('path')}: {message.get('error')}"
                if message.get("severity", 0) >= 2:
                    problems.add(where, line)
                else:
                    print(f"  info {line}")
            for error in report.get("errors", []):
                problems.add(where, f"lint: {error}")
            if chart.schema is not None:
                try:
                    chart.validate_schema(values)
                except helm.HelmError as err:
                    problems.add(where, f"values.schema.json refuses the values: {err}")
            objects = render_objects(chart, values, where, problems)
            problems.check(bool(objects), where, "rendered no object")
            validate_objects(objects, where, CustomResources(docs.root), problems)
            for (_, name), obj in objects.items():
                check_rbac(obj, f"{where} {name}", problems)
                check_pod_security(obj, f"{where} {name}", problems)
                check_env_and_commands(obj, f"{where} {name}", docs, problems)
                check_against_binaries(
                    obj, f"{where} {name}", clis, images if values is None else None, problems
                )
            if chart.name == "flatnet" and values is None:
                check_cli_rejects(objects, clis, images, problems)
                if dump is not None:
                    dump.write_text(json.dumps(list(objects.values()), indent=1, sort_keys=True))
            if chart.name == "flatnet":
                merged = deep_merge(defaults, values or {})
                check_values_reach_objects(objects, merged, app_version, where, problems)
            print(f"<== {where}: {len(objects)} objects, {'ok' if len(problems.items) == before else 'FAILED'}")
            passed += len(problems.items) == before
            failed += len(problems.items) != before
        if chart.name == "flatnet":
            before = len(problems.items)
            check_legacy_values(chart, chart_dir, problems)
            print(f"<== {chart_dir.name} [{LEGACY_VALUES}]: {'ok' if len(problems.items) == before else 'FAILED'}")
            passed += len(problems.items) == before
            failed += len(problems.items) != before
        if chart.schema is not None:
            where = f"{chart_dir.name} [schema]"
            print(f"==> {where}")
            before = len(problems.items)
            for description, path, bad in SCHEMA_REJECTS:
                try:
                    chart.validate_schema(set_path(defaults, path, bad))
                except helm.HelmError:
                    continue
                problems.add(where, f"values.schema.json accepts {description}: {'.'.join(path)}={bad!r}")
            print(f"<== {where}: {len(SCHEMA_REJECTS)} bad values, {'ok' if len(problems.items) == before else 'FAILED'}")
            passed += len(problems.items) == before
            failed += len(problems.items) != before
    return passed, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, required=True, help="workspace root")
    parser.add_argument(
        "--binaries", type=pathlib.Path, required=True, help="directory of the built flatnet binaries"
    )
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="COMPONENT=REFERENCE",
        help="the image `cargo xtask images` builds for a component (agent, operator)",
    )
    parser.add_argument("--dump", type=pathlib.Path, help="write the default render of the flatnet chart here")
    args = parser.parse_args()
    root: pathlib.Path = args.root.resolve()
    print(f"helm-c {helm.helm_c_version()}, Helm SDK {helm.helm_sdk_version()}, Kubernetes schemas {KUBE_VERSION}")
    problems = Problems()
    docs = Documented(root)
    clis = {}
    for component in ("agent", "operator"):
        path = args.binaries / f"flatnet-{component}"
        clis[component] = CliSurface(path)
        envs = sum(1 for flags in clis[component].commands.values() for env, _ in flags.values() if env)
        print(f"{path.name}: {len(clis[component].commands)} commands, {envs} env variables read from {path}")
        problems.check(envs > 0, str(path), "no [env: ...] in its -h output: not understood")
    images = dict(item.split("=", 1) for item in args.image)
    if set(images) != {"agent", "operator"}:
        print("--image agent=... and --image operator=... are required", file=sys.stderr)
        return 2
    passed = failed = 0
    for chart_dir in sorted((root / "charts").iterdir()):
        if (chart_dir / "Chart.yaml").exists():
            chart_passed, chart_failed = check_chart(chart_dir, docs, clis, images, args.dump, problems)
            passed += chart_passed
            failed += chart_failed
    if problems.items:
        print(f"\n{len(problems.items)} chart problem(s):", file=sys.stderr)
        for item in problems.items:
            print(f"  - {item}", file=sys.stderr)
    # The closing line counts the checked value sets (and the schema checks).
    print(f"charts: {passed} passed, {failed} failed")
    return 1 if problems.items else 0


if __name__ == "__main__":
    sys.exit(main())
