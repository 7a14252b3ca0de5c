//! The fake refuses what a real API server refuses.

use flatnet_k8s::{api::FlatNetworkSubnet, keys::SUBNET_NAMESPACE};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::{
    Api,
    api::{ObjectMeta, PostParams},
};

use super::FakeApiServer;
use crate::{allocation::fake_cluster::subnet, nad::NetworkAttachmentDefinition};

/// The 422 a v1.28 server answers a PUT without `metadata.resourceVersion`
/// of `resource` (`plural.group`) named `name`.
fn assert_refused_unconditional(result: kube::Result<impl std::fmt::Debug>, resource: &str) {
    let Err(kube::Error::Api(status)) = result else {
        panic!("a {resource} PUT without resourceVersion was accepted: {result:?}");
    };
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        status.message,
        format!(
            "{resource} \"x\" is invalid: metadata.resourceVersion: Invalid value: 0x0: \
             must be specified for an update"
        )
    );
    let details = status.details.expect("an Invalid status has details");
    let (plural, group) = resource.split_once('.').expect("plural.group");
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("x", group, plural)
    );
    let cause = &details.causes[0];
    assert_eq!(
        (cause.reason.as_str(), cause.field.as_str()),
        ("FieldValueInvalid", "metadata.resourceVersion")
    );
}

/// A custom resource, like every kind whose strategy disallows an
/// unconditional update, is refused a PUT (object or status) without
/// resourceVersion; with the current one it is written.
#[tokio::test]
async fn a_custom_resource_put_without_resource_version_is_invalid() {
    let server = FakeApiServer::new();
    server.insert(&subnet("x", "10.0.0.0/24", None, &[]));
    let api: Api<FlatNetworkSubnet> = Api::namespaced(server.client(), SUBNET_NAMESPACE);
    let mut read = api.get("x").await.unwrap();
    let version = read.metadata.resource_version.take();
    read.spec.master = "eth1".into();
    let resource = "flatnetworksubnets.flatnetwork.pandaria.io";
    assert_refused_unconditional(
        api.replace("x", &PostParams::default(), &read).await,
        resource,
    );
    assert_refused_unconditional(
        api.replace_status("x", &PostParams::default(), &read).await,
        resource,
    );
    assert_eq!(
        api.get("x").await.unwrap().spec.master,
        "eth0",
        "nothing was written"
    );

    read.metadata.resource_version = version;
    let written = api
        .replace("x", &PostParams::default(), &read)
        .await
        .unwrap();
    assert_eq!(written.spec.master, "eth1");
    let written = api
        .replace_status("x", &PostParams::default(), &written)
        .await
        .unwrap();
    assert_eq!(written.spec.master, "eth1");
}

/// Multus' attachments are custom resources too, and Leases' strategy
/// disallows an unconditional update as well.
#[tokio::test]
async fn attachments_and_leases_need_a_resource_version_to_be_replaced() {
    let server = FakeApiServer::new();
    let meta = || ObjectMeta {
        name: Some("x".into()),
        namespace: Some("ns".into()),
        ..ObjectMeta::default()
    };
    let nad = NetworkAttachmentDefinition {
        metadata: meta(),
        spec: crate::nad::NetworkAttachmentDefinitionSpec::default(),
    };
    server.insert(&nad);
    let lease = Lease {
        metadata: meta(),
        ..Lease::default()
    };
    server.insert(&lease);

    let nads: Api<NetworkAttachmentDefinition> = Api::namespaced(server.client(), "ns");
    assert_refused_unconditional(
        nads.replace("x", &PostParams::default(), &nad).await,
        "network-attachment-definitions.k8s.cni.cncf.io",
    );
    let leases: Api<Lease> = Api::namespaced(server.client(), "ns");
    assert_refused_unconditional(
        leases.replace("x", &PostParams::default(), &lease).await,
        "leases.coordination.k8s.io",
    );
}

/// A ConfigMap's strategy allows an unconditional update: a PUT without
/// resourceVersion overwrites it.
#[tokio::test]
async fn a_config_map_put_without_resource_version_is_written() {
    let server = FakeApiServer::new();
    let mut map = ConfigMap {
        metadata: ObjectMeta {
            name: Some("x".into()),
            namespace: Some("ns".into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    };
    server.insert(&map);
    map.data = Some([("k".to_owned(), "v".to_owned())].into());
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "ns");
    let written = api
        .replace("x", &PostParams::default(), &map)
        .await
        .unwrap();
    assert_eq!(written.data, map.data);
}

/// Field selectors select as a real server's do, in lists and watches, and
/// a field label the kind does not support is refused with 400.
#[tokio::test]
async fn field_selectors_select_and_unknown_labels_are_refused() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::{
        ResourceExt,
        api::ListParams,
        runtime::{WatchStreamExt, watcher},
    };
    let server = FakeApiServer::new();
    let pod = |name: &str, node: &str| -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node, "containers": []}
        }))
        .unwrap()
    };
    server.insert(&pod("a", "node-1"));
    server.insert(&pod("b", "node-2"));
    let pods: Api<Pod> = Api::all(server.client());
    let names = |list: kube::core::ObjectList<Pod>| -> Vec<String> {
        list.items.iter().map(ResourceExt::name_any).collect()
    };
    let on_node = ListParams::default().fields("spec.nodeName=node-1");
    assert_eq!(names(pods.list(&on_node).await.unwrap()), ["a"]);
    let elsewhere = ListParams::default().fields("spec.nodeName!=node-1,metadata.namespace=ns");
    assert_eq!(names(pods.list(&elsewhere).await.unwrap()), ["b"]);
    let unsupported = ListParams::default().fields("spec.hostname=x");
    match pods.list(&unsupported).await {
        Err(kube::Error::Api(response)) => {
            assert_eq!(response.code, 400);
            assert!(
                response
                    .message
                    .contains("field label not supported: spec.hostname")
            );
        }
        other => panic!("expected 400, got {other:?}"),
    }
    // A watch sees only the selected pods, later ones included.
    let config = watcher::Config::default().fields("spec.nodeName=node-1");
    let mut seen = watcher(pods, config).applied_objects().boxed();
    server.insert(&pod("c", "node-2"));
    server.insert(&pod("d", "node-1"));
    let mut names = Vec::new();
    while names.len() < 2 {
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), seen.next())
            .await
            .expect("the watch delivers the selected pods")
            .unwrap()
            .unwrap();
        names.push(next.name_any());
    }
    assert_eq!(names, ["a", "d"]);
}
