//! Standalone mode: policies from the state file, pods from the
//! attachment records.
//!
//! The state file's `policies` (MultiNetworkPolicy objects), `namespaces`
//! (name → labels) and `pods` (`namespace/name` → labels) sections are the
//! policy inputs; the local pods and their addresses are the attachments
//! the agent made (a pod is named by `K8S_POD_NAMESPACE`/`K8S_POD_NAME`
//! of its CNI ADD; without them, namespace `default` and the container ID).
//! The file is re-read when it changes (inotify on its directory, so
//! editors that replace the file and ConfigMap volumes work) and on
//! SIGHUP. A file that does not parse or validate is rejected with an
//! error naming the problem, and the policy in force stays.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd, AsRawFd, RawFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use super::{NoEvents, PolicyController, PolicyMetrics, PolicySink, PolicySnapshot, PolicyTrigger};
use crate::{
    desired::standalone::StateFile,
    policy_compiler::{
        FlatPod, MultiNetworkPolicy, NetworkNames, api::DEFAULT_NETWORK_NAME,
        api::POLICY_FOR_ANNOTATION, selector::Labels,
    },
    records::Records,
};

/// The policy part of a state file, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicySection {
    policies: BTreeMap<(String, String), MultiNetworkPolicy>,
    namespaces: BTreeMap<String, Labels>,
    pods: BTreeMap<(String, String), Labels>,
}

impl PolicySection {
    /// Checks the policy sections of `file`. A policy without a
    /// namespace is in `default`; one without the `policy-for` annotation
    /// applies to the flat network (the state file is flatnet's alone).
    pub fn from_state(file: &StateFile) -> Result<Self, Vec<String>> {
        let mut problems = Vec::new();
        let mut policies = BTreeMap::new();
        for (index, policy) in file.policies.iter().enumerate() {
            let mut policy = policy.clone();
            let Some(name) = policy.metadata.name.clone().filter(|n| !n.is_empty()) else {
                problems.push(format!(
                    "policies[{index}] has no metadata.name; give every policy a name"
                ));
                continue;
            };
            let namespace = policy
                .metadata
                .namespace
                .get_or_insert_with(|| "default".into())
                .clone();
            policy
                .metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .entry(POLICY_FOR_ANNOTATION.into())
                .or_insert_with(|| DEFAULT_NETWORK_NAME.into());
            if policies
                .insert((namespace.clone(), name.clone()), policy)
                .is_some()
            {
                problems.push(format!(
                    "policy {namespace}/{name} is defined twice; keep one or rename one"
                ));
            }
        }
        let mut pods = BTreeMap::new();
        for (key, labels) in &file.pods {
            match key.split_once('/') {
                Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                    pods.insert((ns.to_owned(), name.to_owned()), labels.clone());
                }
                _ => problems.push(format!(
                    "pods: key {key:?} is not namespace/name; write it as e.g. default/web-0"
                )),
            }
        }
        if problems.is_empty() {
            Ok(Self {
                policies,
                namespaces: file.namespaces.clone(),
                pods,
            })
        } else {
            Err(problems)
        }
    }

    /// What changed from `self` to `newer`, for the log.
    pub fn changes(&self, newer: &Self) -> Vec<String> {
        let mut out = Vec::new();
        diff(
            "policy",
            &self.policies,
            &newer.policies,
            |(ns, n)| format!("{ns}/{n}"),
            &mut out,
        );
        diff(
            "namespace labels",
            &self.namespaces,
            &newer.namespaces,
            String::clone,
            &mut out,
        );
        diff(
            "pod labels",
            &self.pods,
            &newer.pods,
            |(ns, n)| format!("{ns}/{n}"),
            &mut out,
        );
        out
    }

    /// The compiler's inputs with `records` as the local pods.
    fn snapshot(&self, records: &Records) -> Result<PolicySnapshot, String> {
        let records = records.all().map_err(|e| e.to_string())?;
        let pods = records
            .iter()
            .filter(|r| !r.addresses.is_empty())
            .map(|r| {
                let (namespace, name) = super::record_pod(r);
                FlatPod {
                    labels: self
                        .pods
                        .get(&(namespace.clone(), name.clone()))
                        .cloned()
                        .unwrap_or_default(),
                    namespace,
                    name,
                    ips: r.ips(),
                    local: true,
                }
            })
            .collect();
        Ok(PolicySnapshot {
            policies: self.policies.values().cloned().collect(),
            namespaces: self.namespaces.clone(),
            pods,
        })
    }
}

fn diff<K: Ord, V: PartialEq>(
    what: &str,
    old: &BTreeMap<K, V>,
    new: &BTreeMap<K, V>,
    name: impl Fn(&K) -> String,
    out: &mut Vec<String>,
) {
    for (key, value) in new {
        match old.get(key) {
            None => out.push(format!("{what} {} added", name(key))),
            Some(previous) if previous != value => {
                out.push(format!("{what} {} changed", name(key)));
            }
            Some(_) => {}
        }
    }
    for key in old.keys().filter(|k| !new.contains_key(*k)) {
        out.push(format!("{what} {} removed", name(key)));
    }
}

/// The standalone policy source: the state file's policy section in
/// force, and the records.
pub struct StandalonePolicies {
    path: PathBuf,
    records: Records,
    metrics: PolicyMetrics,
    current: Mutex<Current>,
}

struct Current {
    section: PolicySection,
    /// The running subnets and networks (they need a restart to change).
    links: String,
    /// The text last read, accepted or not (to act on real changes only).
    text: String,
}

impl StandalonePolicies {
    /// Reads the policy section of the state file at `path` (checked as a
    /// whole); an error names every problem.
    pub fn open(path: &Path, records: Records, metrics: PolicyMetrics) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the state file {}: {e}", path.display()))?;
        Self::open_from(path, text, records, metrics)
    }

    /// [`StandalonePolicies::open`] starting from `text`, the state file
    /// version in force (its last good copy when the file is rejected).
    pub fn open_from(
        path: &Path,
        text: String,
        records: Records,
        metrics: PolicyMetrics,
    ) -> Result<Self, String> {
        let (file, section) = parse(path, &text)?;
        Ok(Self {
            path: path.to_owned(),
            records,
            metrics,
            current: Mutex::new(Current {
                section,
                links: links_of(&file),
                text,
            }),
        })
    }

    /// The policy-for names to accept: `configured`, the state file's
    /// network names, and the name given to policies without the
    /// annotation.
    pub fn networks(&self, configured: &[String]) -> NetworkNames {
        let file = StateFile::read(&self.path).unwrap_or_default();
        let names: BTreeSet<String> = configured
            .iter()
            .cloned()
            .chain(file.networks.iter().map(|n| n.name.clone()))
            .chain([DEFAULT_NETWORK_NAME.to_owned()])
            .collect();
        NetworkNames::new(names)
    }

    /// The compiler's inputs now; `None` (logged) when the records cannot
    /// be read.
    pub fn snapshot(&self) -> Option<PolicySnapshot> {
        let current = self.current.lock().expect("policy state lock");
        match current.section.snapshot(&self.records) {
            Ok(snapshot) => Some(snapshot),
            Err(error) => {
                tracing::error!(%error, "cannot read the attachment records for the network policy");
                None
            }
        }
    }

    /// Re-reads the state file. Returns whether the policy inputs changed;
    /// a rejected file leaves the policy in force and is logged once.
    pub fn reload(&self) -> bool {
        let mut current = self.current.lock().expect("policy state lock");
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(error) => {
                tracing::error!(path = %self.path.display(), %error, "cannot read the state file; the policy in force stays");
                self.metrics.source_problem.set(1);
                return false;
            }
        };
        if text == current.text {
            return false;
        }
        current.text = text;
        match parse(&self.path, &current.text) {
            Ok((file, section)) => {
                self.metrics.source_problem.set(0);
                if links_of(&file) != current.links {
                    tracing::info!(path = %self.path.display(), "subnets or networks in the state file changed; they take effect from the next CNI ADD");
                    current.links = links_of(&file);
                }
                let changes = current.section.changes(&section);
                if changes.is_empty() {
                    return false;
                }
                tracing::info!(path = %self.path.display(), changes = %changes.join(", "), "state file reloaded; applying the network policy");
                current.section = section;
                true
            }
            Err(error) => {
                self.metrics.source_problem.set(1);
                tracing::error!("{error}; the edit is rejected and the policy in force stays");
                false
            }
        }
    }
}

/// Parses and checks the text of the state file (all of it: a file the
/// agent could not start with is not taken on reload either).
fn parse(path: &Path, text: &str) -> Result<(StateFile, PolicySection), String> {
    let file = StateFile::parse(path, text).map_err(|e| e.to_string())?;
    let mut problems = file.validate().err().unwrap_or_default();
    let section = PolicySection::from_state(&file).map_err(|p| {
        problems.extend(p);
        format!("state file {}: {}", path.display(), problems.join("; "))
    })?;
    if !problems.is_empty() {
        return Err(format!(
            "state file {}: {}",
            path.display(),
            problems.join("; ")
        ));
    }
    Ok((file, section))
}

fn links_of(file: &StateFile) -> String {
    serde_json::to_string(&(&file.subnets, &file.networks)).unwrap_or_default()
}

/// Runs the controller on `policies` until the process ends: an initial
/// round, then one after every change of the records (through `trigger`,
/// which the CNI service holds) or of the state file.
pub async fn run<S: PolicySink>(
    policies: Arc<StandalonePolicies>,
    controller: PolicyController<S>,
    trigger: PolicyTrigger,
    changes: super::PolicyChanges,
) {
    tokio::spawn(watch_state_file(Arc::clone(&policies), trigger.clone()));
    trigger.changed();
    controller
        .run(changes, move || policies.snapshot(), NoEvents)
        .await;
}

/// Reloads on SIGHUP and on any change in the state file's directory.
async fn watch_state_file(policies: Arc<StandalonePolicies>, trigger: PolicyTrigger) {
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(error) => {
            tracing::warn!(%error, "cannot handle SIGHUP; the state file is reloaded on change only");
            None
        }
    };
    let inotify = match directory_watch(&policies.path) {
        Ok(fd) => Some(fd),
        Err(error) => {
            tracing::warn!(%error, path = %policies.path.display(), "cannot watch the state file; send SIGHUP to reload it");
            None
        }
    };
    loop {
        tokio::select! {
            Some(()) = async { hangup.as_mut()?.recv().await } => {
                tracing::info!("SIGHUP: reloading the state file");
            }
            Some(()) = async { next_change(inotify.as_ref()?).await } => {}
            else => return,
        }
        if policies.reload() {
            trigger.changed();
        }
    }
}

struct WatchFd(Inotify);

impl AsRawFd for WatchFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// An inotify watch on the directory of `path`: editors replace files and
/// ConfigMap volumes swap a symlinked directory, which a watch on the file
/// itself would miss.
fn directory_watch(path: &Path) -> std::io::Result<AsyncFd<WatchFd>> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(
        dir,
        AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE,
    )?;
    // SAFETY: the descriptor is owned by the `Inotify` inside the
    // `AsyncFd` and stays open, unchanged, until the `AsyncFd` is dropped.
    unsafe { AsyncFd::register(WatchFd(inotify)) }.map_err(Into::into)
}

/// Waits for events on the watch and drains them. `None` when the watch
/// fails.
async fn next_change(fd: &AsyncFd<WatchFd>) -> Option<()> {
    loop {
        let mut ready = fd.readable().await.ok()?;
        match ready.get_inner().0.read_events() {
            Ok(events) if !events.is_empty() => return Some(()),
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
            Err(error) => {
                tracing::warn!(%error, "the state file watch failed; send SIGHUP to reload it");
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(yaml: &str) -> StateFile {
        serde_yaml::from_str(yaml).unwrap()
    }

    const POLICY: &str = r#"
policies:
  - apiVersion: k8s.cni.cncf.io/v1beta1
    kind: MultiNetworkPolicy
    metadata: {name: web}
    spec:
      podSelector: {matchLabels: {app: web}}
      ingress: [{ports: [{port: 80}]}]
namespaces:
  default: {team: a}
pods:
  default/web-0: {app: web}
"#;

    #[test]
    fn policies_default_their_namespace_and_network() {
        let section = PolicySection::from_state(&state(POLICY)).unwrap();
        let policy = &section.policies[&("default".to_owned(), "web".to_owned())];
        assert!(NetworkNames::default().selects("default", policy.metadata.annotations.as_ref()));
        assert_eq!(
            section.pods[&("default".into(), "web-0".into())]["app"],
            "web"
        );
    }

    #[test]
    fn bad_sections_name_the_entry_and_the_fix() {
        let bad = state(
            r#"
policies:
  - {apiVersion: k8s.cni.cncf.io/v1beta1, kind: MultiNetworkPolicy, metadata: {}, spec: {}}
  - {apiVersion: k8s.cni.cncf.io/v1beta1, kind: MultiNetworkPolicy, metadata: {name: a}, spec: {}}
  - {apiVersion: k8s.cni.cncf.io/v1beta1, kind: MultiNetworkPolicy, metadata: {name: a, namespace: default}, spec: {}}
pods:
  web-0: {app: web}
"#,
        );
        let problems = PolicySection::from_state(&bad).unwrap_err();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("policies[0] has no metadata.name"));
        assert!(problems[1].contains("default/a is defined twice"));
        assert!(problems[2].contains("\"web-0\" is not namespace/name"));
    }

    #[test]
    fn changes_are_described() {
        let old = PolicySection::from_state(&state(POLICY)).unwrap();
        let edited = POLICY
            .replace("port: 80", "port: 81")
            .replace("team: a", "team: b")
            .replace("default/web-0", "default/web-1");
        let new = PolicySection::from_state(&state(&edited)).unwrap();
        assert_eq!(
            old.changes(&new),
            vec![
                "policy default/web changed",
                "namespace labels default changed",
                "pod labels default/web-1 added",
                "pod labels default/web-0 removed",
            ]
        );
        assert!(old.changes(&old).is_empty());
    }

    #[test]
    fn a_rejected_edit_keeps_the_policy_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.yaml");
        std::fs::write(&path, POLICY).unwrap();
        let records = Records::open(&dir.path().join("records")).unwrap();
        let metrics = PolicyMetrics::default();
        let policies = StandalonePolicies::open(&path, records, metrics.clone()).unwrap();
        let before = policies.snapshot().unwrap();

        std::fs::write(
            &path,
            POLICY.replace("metadata: {name: web}", "metadata: {}"),
        )
        .unwrap();
        assert!(!policies.reload());
        assert_eq!(policies.snapshot().unwrap(), before);
        assert_eq!(metrics.source_problem.get(), 1);

        std::fs::write(&path, POLICY.replace("port: 80", "port: 81")).unwrap();
        assert!(policies.reload());
        assert_ne!(policies.snapshot().unwrap(), before);
        assert_eq!(metrics.source_problem.get(), 0);
        assert!(!policies.reload(), "unchanged file: nothing to do");
    }
}
