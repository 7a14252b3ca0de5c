//! The agent finds the network namespace of a pod it did not attach
//! through the container runtime's CRI socket (`flatnet_agent::cri`),
//! against a runtime that answers as containerd does.

mod support;

use std::path::Path;

use flatnet_agent::{
    cri::{CriError, PodSandboxes},
    desired::PodRef,
};
use support::cri::{FakeCri, Sandbox};

fn pod(namespace: &str, name: &str, uid: Option<&str>) -> PodRef {
    PodRef {
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: uid.map(Into::into),
    }
}

/// A runtime serving `fake` on a socket in a new directory.
fn serve(fake: &FakeCri) -> (tempfile::TempDir, PodSandboxes) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cri.sock");
    fake.serve(&socket);
    (dir, PodSandboxes::new(&socket))
}

fn runtime_with_pods(fake: &FakeCri) {
    fake.add(Sandbox::ready(
        "shop",
        "web-0",
        Path::new("/var/run/netns/cni-web-0"),
    ));
    // The same name in another namespace, and a sandbox being replaced.
    fake.add(Sandbox::ready(
        "other",
        "web-0",
        Path::new("/var/run/netns/cni-other"),
    ));
    fake.add(Sandbox {
        id: "web-1-old".into(),
        ready: false,
        ..Sandbox::ready("shop", "web-1", Path::new("/var/run/netns/cni-web-1-old"))
    });
    fake.add(Sandbox {
        attempt: 1,
        ..Sandbox::ready("shop", "web-1", Path::new("/var/run/netns/cni-web-1"))
    });
    fake.add(Sandbox {
        host_network: true,
        ..Sandbox::ready("shop", "host-agent", Path::new("/proc/1/ns/net"))
    });
}

async fn lookups_find_each_pods_own_ready_sandbox(fake: FakeCri) {
    runtime_with_pods(&fake);
    let (_dir, sandboxes) = serve(&fake);
    for (pod, netns) in [
        (pod("shop", "web-0", None), "/var/run/netns/cni-web-0"),
        (
            pod("shop", "web-0", Some("uid-web-0")),
            "/var/run/netns/cni-web-0",
        ),
        (pod("other", "web-0", None), "/var/run/netns/cni-other"),
        (pod("shop", "web-1", None), "/var/run/netns/cni-web-1"),
    ] {
        assert_eq!(
            sandboxes.network_namespace(&pod).await.unwrap(),
            Path::new(netns),
            "{pod}"
        );
    }
    // Another pod of the same name (a different UID) is not this one.
    let error = sandboxes
        .network_namespace(&pod("shop", "web-0", Some("uid-of-a-new-pod")))
        .await
        .unwrap_err();
    assert!(matches!(error, CriError::NoSandbox { .. }), "{error}");
}

#[tokio::test]
async fn the_pods_ready_sandbox_names_its_namespace() {
    lookups_find_each_pods_own_ready_sandbox(FakeCri::default()).await;
}

#[tokio::test]
async fn a_runtime_that_ignores_the_filter_is_checked_all_the_same() {
    lookups_find_each_pods_own_ready_sandbox(FakeCri {
        ignore_filters: true,
        ..FakeCri::default()
    })
    .await;
}

#[tokio::test]
async fn unknown_host_network_and_unreachable_say_why() {
    let fake = FakeCri::default();
    runtime_with_pods(&fake);
    let (dir, sandboxes) = serve(&fake);

    let error = sandboxes
        .network_namespace(&pod("shop", "gone", None))
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("has no ready sandbox of pod shop/gone"),
        "{error}"
    );
    let error = sandboxes
        .network_namespace(&pod("shop", "host-agent", None))
        .await
        .unwrap_err();
    assert!(matches!(error, CriError::HostNetwork(_)), "{error}");
    let error = sandboxes
        .network_namespace(&PodRef::default())
        .await
        .unwrap_err();
    assert!(matches!(error, CriError::Unnamed(_)), "{error}");

    let absent = PodSandboxes::new(&dir.path().join("no-runtime.sock"));
    let error = absent
        .network_namespace(&pod("shop", "web-0", None))
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("no-runtime.sock") && message.contains("--cri-socket"),
        "{message}"
    );
}
