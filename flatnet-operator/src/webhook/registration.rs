//! The ValidatingWebhookConfiguration that sends reviews to the webhook.
//!
//! Three webhooks share one configuration:
//! - `subnets.flatnetwork.pandaria.io`: FlatNetworkSubnet create, update and
//!   delete, `failurePolicy: Fail` (subnets are admin objects, and a delete
//!   while addresses are in use must never slip through), and
//!   PodNetworkConfig create and update (the subnets it may use);
//! - `workloads.flatnetwork.pandaria.io`: Pods and the workload kinds on
//!   create and update, `failurePolicy: Fail`, but only for objects that
//!   carry a flat annotation (a CEL `matchCondition`), so an unavailable
//!   webhook never blocks pods that do not use the flat network;
//! - `floating.flatnetwork.pandaria.io`: FloatingIPPools, quotas, the
//!   LoadBalancer Services of flatnet's class, and the pods and workloads
//!   whose pod (template) asks for a floating address (a CEL
//!   `matchCondition`).

use std::collections::BTreeMap;

use k8s_openapi::{
    ByteString,
    api::admissionregistration::v1::{
        MatchCondition, RuleWithOperations, ServiceReference, ValidatingWebhook,
        ValidatingWebhookConfiguration, WebhookClientConfig,
    },
};
use kube::{
    Api, Client, ResourceExt,
    api::{ObjectMeta, Patch, PatchParams},
};

use crate::{config::WebhookSettings, flat_services::FIELD_MANAGER};
use flatnet_k8s::keys::label;

/// Path the webhooks post their reviews to.
pub const VALIDATE_PATH: &str = "/validate";
/// Name of the subnet webhook.
pub const SUBNET_WEBHOOK: &str = "subnets.flatnetwork.pandaria.io";
/// Name of the floating-address webhook.
pub const FLOATING_WEBHOOK: &str = "floating.flatnetwork.pandaria.io";
/// Sends only the Services of flatnet's `loadBalancerClass`, the pods
/// asking for a floating address and the workloads whose pod template
/// does (pools and quotas always), so an unavailable webhook never blocks
/// other Services, pods or workloads.
pub const FLOATING_REQUESTS_CONDITION: &str = "request.kind.kind == 'Pod' ? \
(has(object.metadata.annotations) && \
('flatnetwork.pandaria.io/floating-ip-pool' in object.metadata.annotations || \
'flatnetwork.pandaria.io/floating-ip' in object.metadata.annotations)) : \
request.kind.kind == 'Service' ? \
(has(object.spec.type) && object.spec.type == 'LoadBalancer' && \
has(object.spec.loadBalancerClass) && \
object.spec.loadBalancerClass == 'flatnetwork.pandaria.io/floating-ip') : \
request.kind.kind == 'CronJob' ? \
(has(object.spec) && has(object.spec.jobTemplate) && has(object.spec.jobTemplate.spec) && \
has(object.spec.jobTemplate.spec.template) && has(object.spec.jobTemplate.spec.template.metadata) && \
has(object.spec.jobTemplate.spec.template.metadata.annotations) && \
('flatnetwork.pandaria.io/floating-ip-pool' in object.spec.jobTemplate.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/floating-ip' in object.spec.jobTemplate.spec.template.metadata.annotations)) : \
request.kind.kind in ['Deployment', 'ReplicaSet', 'StatefulSet', 'DaemonSet', 'Job'] ? \
(has(object.spec) && has(object.spec.template) && has(object.spec.template.metadata) && \
has(object.spec.template.metadata.annotations) && \
('flatnetwork.pandaria.io/floating-ip-pool' in object.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/floating-ip' in object.spec.template.metadata.annotations)) : \
true";
/// Name of the pod and workload webhook.
pub const WORKLOAD_WEBHOOK: &str = "workloads.flatnetwork.pandaria.io";
/// How long the API server waits for an answer.
const TIMEOUT_SECONDS: i32 = 10;

/// Sends only objects with a flat annotation on themselves (Pods), their pod
/// template (Deployment, ReplicaSet, StatefulSet, DaemonSet, Job) or their
/// job's pod template (CronJob).
pub const FLAT_ANNOTATIONS_CONDITION: &str = "\
(has(object.metadata.annotations) && \
('flatnetwork.pandaria.io/subnet' in object.metadata.annotations || \
'flatnetwork.pandaria.io/ip' in object.metadata.annotations || \
'flatnetwork.pandaria.io/mac' in object.metadata.annotations)) || \
(has(object.spec) && has(object.spec.template) && has(object.spec.template.metadata) && \
has(object.spec.template.metadata.annotations) && \
('flatnetwork.pandaria.io/subnet' in object.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/ip' in object.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/mac' in object.spec.template.metadata.annotations)) || \
(has(object.spec) && has(object.spec.jobTemplate) && has(object.spec.jobTemplate.spec) && \
has(object.spec.jobTemplate.spec.template) && has(object.spec.jobTemplate.spec.template.metadata) && \
has(object.spec.jobTemplate.spec.template.metadata.annotations) && \
('flatnetwork.pandaria.io/subnet' in object.spec.jobTemplate.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/ip' in object.spec.jobTemplate.spec.template.metadata.annotations || \
'flatnetwork.pandaria.io/mac' in object.spec.jobTemplate.spec.template.metadata.annotations))";

fn rule(
    group: &str,
    versions: &[&str],
    resources: &[&str],
    operations: &[&str],
) -> RuleWithOperations {
    let strings = |items: &[&str]| Some(items.iter().map(|s| (*s).to_owned()).collect());
    RuleWithOperations {
        api_groups: strings(&[group]),
        api_versions: strings(versions),
        operations: strings(operations),
        resources: strings(resources),
        scope: Some("Namespaced".into()),
    }
}

/// Create and update of the workload kinds that make pods from a template.
fn workload_rules() -> [RuleWithOperations; 2] {
    let create_update = ["CREATE", "UPDATE"];
    [
        rule(
            "apps",
            &["v1"],
            &["deployments", "replicasets", "statefulsets", "daemonsets"],
            &create_update,
        ),
        rule("batch", &["v1"], &["jobs", "cronjobs"], &create_update),
    ]
}

/// The configuration for `settings`, trusting the PEM bundle `ca_bundle`.
#[must_use]
pub fn desired(settings: &WebhookSettings, ca_bundle: &str) -> ValidatingWebhookConfiguration {
    let client_config = WebhookClientConfig {
        ca_bundle: Some(ByteString(ca_bundle.as_bytes().to_vec())),
        service: settings.url.is_none().then(|| ServiceReference {
            name: settings.service.clone(),
            namespace: settings.namespace.clone(),
            path: Some(VALIDATE_PATH.into()),
            port: Some(443),
        }),
        url: settings.url.as_ref().map(|u| u.url.clone()),
    };
    let webhook = |name: &str, rules, conditions| ValidatingWebhook {
        name: name.into(),
        admission_review_versions: vec!["v1".into()],
        client_config: client_config.clone(),
        failure_policy: Some("Fail".into()),
        match_policy: Some("Equivalent".into()),
        match_conditions: conditions,
        rules: Some(rules),
        side_effects: "None".into(),
        timeout_seconds: Some(TIMEOUT_SECONDS),
        ..ValidatingWebhook::default()
    };
    let create_update = ["CREATE", "UPDATE"];
    ValidatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(settings.configuration.clone()),
            labels: Some(BTreeMap::from([(
                label::MANAGED_BY.to_owned(),
                label::MANAGED_BY_FLATNET.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        webhooks: Some(vec![
            webhook(
                SUBNET_WEBHOOK,
                vec![
                    rule(
                        flatnet_k8s::api::GROUP,
                        &["v1"],
                        &["flatnetworksubnets"],
                        &["CREATE", "UPDATE", "DELETE"],
                    ),
                    // Tenants' runtime configuration names subnets.
                    rule(
                        flatnet_k8s::api::GROUP,
                        &["v1"],
                        &["podnetworkconfigs"],
                        &create_update,
                    ),
                    // The one cluster configuration object, on update: the
                    // chart creates it in the same install as this
                    // configuration, before any operator serves the webhook
                    // (its values are checked by the chart's schema).
                    RuleWithOperations {
                        scope: Some("Cluster".into()),
                        ..rule(
                            flatnet_k8s::api::GROUP,
                            &["v1"],
                            &["flatnetworkconfigs"],
                            &["UPDATE"],
                        )
                    },
                ],
                None,
            ),
            webhook(
                WORKLOAD_WEBHOOK,
                [rule("", &["v1"], &["pods"], &create_update)]
                    .into_iter()
                    .chain(workload_rules())
                    .collect(),
                Some(vec![MatchCondition {
                    name: "has-flat-network-annotations".into(),
                    expression: FLAT_ANNOTATIONS_CONDITION.into(),
                }]),
            ),
            webhook(
                FLOATING_WEBHOOK,
                vec![
                    RuleWithOperations {
                        scope: Some("Cluster".into()),
                        ..rule(
                            flatnet_k8s::api::GROUP,
                            &["v1"],
                            &["floatingippools"],
                            &["CREATE", "UPDATE", "DELETE"],
                        )
                    },
                    RuleWithOperations {
                        scope: Some("Cluster".into()),
                        ..rule(
                            flatnet_k8s::api::GROUP,
                            &["v1"],
                            &["floatingipprojectquotas"],
                            &create_update,
                        )
                    },
                    rule("", &["v1"], &["services", "pods"], &create_update),
                ]
                .into_iter()
                .chain(workload_rules())
                .collect(),
                Some(vec![MatchCondition {
                    name: "floating-ip-requests-only".into(),
                    expression: FLOATING_REQUESTS_CONDITION.into(),
                }]),
            ),
        ]),
    }
}

/// Field manager of the CA bundles the operator writes into a
/// configuration it does not own: only `webhooks[name].clientConfig.caBundle`.
pub const CA_BUNDLE_MANAGER: &str = "flatnet-operator-ca-bundle";

/// Why the webhook could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The chart's configuration is missing.
    #[error(
        "ValidatingWebhookConfiguration {name} does not exist; the chart creates it (helm upgrade restores it) and the operator only writes its CA bundle"
    )]
    Missing {
        /// Name.
        name: String,
    },
    /// A configuration of that name belongs to someone else (URL mode).
    #[error(
        "ValidatingWebhookConfiguration {name} exists and is not the operator's ({managed_by}); the operator never replaces a configuration it did not create: name another with --webhook-config"
    )]
    NotOurs {
        /// Name.
        name: String,
        /// Its `app.kubernetes.io/managed-by` label, or `unlabelled`.
        managed_by: String,
    },
    /// An API call failed.
    #[error(
        "{op} ValidatingWebhookConfiguration {name}: {source}{}",
        crate::controller::forbidden_hint(source, op, None)
    )]
    Api {
        /// What was attempted.
        op: &'static str,
        /// Name.
        name: String,
        /// The API error.
        #[source]
        source: Box<kube::Error>,
    },
}

fn api_error(op: &'static str, name: &str) -> impl FnOnce(kube::Error) -> RegistrationError {
    let name = name.to_owned();
    move |source| RegistrationError::Api {
        op,
        name,
        source: Box::new(source),
    }
}

/// Writes `ca_bundle` into every webhook of the configuration `name`,
/// which the chart creates and owns: a server-side apply of only each
/// webhook's `clientConfig.caBundle` (`webhooks` is a map list keyed by
/// `name`) by [`CA_BUNDLE_MANAGER`], so Helm and the operator never own the
/// same field. Never creates, replaces or deletes the configuration.
///
/// # Errors
/// The configuration is missing, or the API calls failed.
pub async fn inject_ca_bundle(
    client: &Client,
    name: &str,
    ca_bundle: &str,
) -> Result<(), RegistrationError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let existing = api
        .get_opt(name)
        .await
        .map_err(api_error("get", name))?
        .ok_or_else(|| RegistrationError::Missing {
            name: name.to_owned(),
        })?;
    let bundle = ByteString(ca_bundle.as_bytes().to_vec());
    let webhooks: Vec<serde_json::Value> = existing
        .webhooks
        .iter()
        .flatten()
        .map(|w| serde_json::json!({"name": w.name, "clientConfig": {"caBundle": bundle}}))
        .collect();
    let patch = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": webhooks,
    });
    // Forced: the bundle is the operator's alone, whoever wrote it before.
    api.patch(
        name,
        &PatchParams::apply(CA_BUNDLE_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(api_error("apply", name))?;
    Ok(())
}

/// Applies `desired`, a configuration the operator creates and owns whole
/// (`--webhook-url`, out of a cluster: no chart made one). One of that
/// name it did not create is left alone and reported.
///
/// # Errors
/// A configuration of that name is not the operator's, or the API calls
/// failed.
pub async fn apply_own(
    client: &Client,
    desired: &ValidatingWebhookConfiguration,
) -> Result<(), RegistrationError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let name = desired.name_any();
    if let Some(existing) = api.get_opt(&name).await.map_err(api_error("get", &name))? {
        let managed_by = existing.labels().get(label::MANAGED_BY);
        if managed_by.map(String::as_str) != Some(label::MANAGED_BY_FLATNET) {
            return Err(RegistrationError::NotOurs {
                name,
                managed_by: managed_by.map_or_else(|| "unlabelled".to_owned(), Clone::clone),
            });
        }
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(desired),
    )
    .await
    .map_err(api_error("apply", &name))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WebhookUrl;

    fn settings(url: Option<&str>) -> WebhookSettings {
        WebhookSettings {
            enabled: true,
            listen: "0.0.0.0:443".parse().unwrap(),
            namespace: "cattle-flat-network".into(),
            service: "rancher-flat-network-webhook-svc".into(),
            secret: "rancher-flat-network-webhook-certs".into(),
            configuration: "rancher-flat-network-subnets-validating-config".into(),
            url: url.map(|u| WebhookUrl {
                url: u.into(),
                host: "127.0.0.1".into(),
            }),
        }
    }

    #[test]
    fn service_mode_points_both_webhooks_at_the_service() {
        let config = desired(&settings(None), "PEM");
        let webhooks = config.webhooks.unwrap();
        assert_eq!(webhooks.len(), 3);
        for webhook in &webhooks {
            let service = webhook.client_config.service.as_ref().unwrap();
            assert_eq!(service.name, "rancher-flat-network-webhook-svc");
            assert_eq!(service.namespace, "cattle-flat-network");
            assert_eq!(service.path.as_deref(), Some("/validate"));
            assert!(webhook.client_config.url.is_none());
            assert_eq!(
                webhook.client_config.ca_bundle,
                Some(ByteString(b"PEM".to_vec()))
            );
            assert_eq!(webhook.failure_policy.as_deref(), Some("Fail"));
            assert_eq!(webhook.side_effects, "None");
        }
        let subnet_rules = webhooks[0].rules.as_ref().unwrap();
        assert_eq!(
            subnet_rules[0].operations.as_deref(),
            Some(&["CREATE".to_owned(), "UPDATE".into(), "DELETE".into()][..])
        );
        let workload_rules = webhooks[1].rules.as_ref().unwrap();
        let resources: Vec<&str> = workload_rules
            .iter()
            .flat_map(|r| r.resources.iter().flatten())
            .map(String::as_str)
            .collect();
        assert_eq!(
            resources,
            [
                "pods",
                "deployments",
                "replicasets",
                "statefulsets",
                "daemonsets",
                "jobs",
                "cronjobs"
            ]
        );
        assert!(webhooks[0].match_conditions.is_none());
        assert_eq!(webhooks[1].match_conditions.as_ref().unwrap().len(), 1);
        // The floating webhook: pools, quotas, Services, and every kind
        // whose pods may ask for a floating address.
        let floating_resources: Vec<&str> = webhooks[2]
            .rules
            .iter()
            .flatten()
            .flat_map(|r| r.resources.iter().flatten())
            .map(String::as_str)
            .collect();
        for resource in resources.iter().chain(&["services", "floatingippools"]) {
            assert!(floating_resources.contains(resource), "{resource}");
        }
    }

    /// What the API server makes of `condition` for an object of `kind`
    /// (`object` null as on a DELETE): whether it sends the review. An
    /// evaluation error fails the test (the API server would refuse the
    /// request under `failurePolicy: Fail`).
    fn sends(condition: &str, kind: &str, object: &serde_json::Value) -> bool {
        let program = cel::Program::compile(condition).expect("the condition compiles");
        let mut context = cel::Context::default();
        let request = serde_json::json!({"kind": {"kind": kind}});
        context.add_variable_from_value("request", cel::to_value(&request).unwrap());
        context.add_variable_from_value("object", cel::to_value(object).unwrap());
        match program.execute(&context) {
            Ok(cel::Value::Bool(send)) => send,
            other => panic!("{kind} {object}: the condition gave {other:?}"),
        }
    }

    /// An object of `kind` carrying `annotations` where its pods take them
    /// from (its own metadata for a Pod), and `own` on its own metadata.
    fn carrying(
        kind: &str,
        annotations: &serde_json::Value,
        own: &serde_json::Value,
    ) -> serde_json::Value {
        let template = serde_json::json!({"metadata": {"annotations": annotations}});
        let spec = match kind {
            "Pod" => {
                return serde_json::json!({"metadata": {"name": "p", "annotations": annotations}, "spec": {}});
            }
            "CronJob" => serde_json::json!({"jobTemplate": {"spec": {"template": template}}}),
            _ => serde_json::json!({"template": template}),
        };
        serde_json::json!({"metadata": {"name": "w", "annotations": own}, "spec": spec})
    }

    const WORKLOAD_KINDS: [&str; 7] = crate::webhook::workload::KINDS;

    #[test]
    fn the_floating_condition_sends_only_floating_requests() {
        let none = serde_json::json!({});
        let other = serde_json::json!({"team": "a"});
        for key in [
            "flatnetwork.pandaria.io/floating-ip-pool",
            "flatnetwork.pandaria.io/floating-ip",
        ] {
            let asking = serde_json::json!({key: "x"});
            for kind in WORKLOAD_KINDS {
                assert!(
                    sends(
                        FLOATING_REQUESTS_CONDITION,
                        kind,
                        &carrying(kind, &asking, &none)
                    ),
                    "{kind} with {key}"
                );
                // On the workload itself, not its pods: nothing asked.
                if kind != "Pod" {
                    assert!(
                        !sends(
                            FLOATING_REQUESTS_CONDITION,
                            kind,
                            &carrying(kind, &other, &asking)
                        ),
                        "{kind} with {key} on itself"
                    );
                }
                assert!(
                    !sends(
                        FLOATING_REQUESTS_CONDITION,
                        kind,
                        &carrying(kind, &other, &none)
                    ),
                    "{kind} with other annotations"
                );
            }
        }
        // Templates (and pods) without annotations, or without metadata.
        for kind in WORKLOAD_KINDS {
            let bare = match kind {
                "Pod" => serde_json::json!({"metadata": {"name": "p"}, "spec": {}}),
                "CronJob" => {
                    serde_json::json!({"metadata": {"name": "c"}, "spec": {"jobTemplate": {"spec": {"template": {}}}}})
                }
                _ => {
                    serde_json::json!({"metadata": {"name": "w"}, "spec": {"template": {"spec": {}}}})
                }
            };
            assert!(
                !sends(FLOATING_REQUESTS_CONDITION, kind, &bare),
                "bare {kind}"
            );
        }
        let service =
            |spec: serde_json::Value| serde_json::json!({"metadata": {"name": "s"}, "spec": spec});
        let class = flatnet_k8s::floating::LOAD_BALANCER_CLASS;
        assert!(sends(
            FLOATING_REQUESTS_CONDITION,
            "Service",
            &service(serde_json::json!({"type": "LoadBalancer", "loadBalancerClass": class}))
        ));
        for spec in [
            serde_json::json!({"type": "LoadBalancer"}),
            serde_json::json!({"type": "ClusterIP"}),
            serde_json::json!({"type": "LoadBalancer", "loadBalancerClass": "metallb.io/metallb"}),
        ] {
            assert!(
                !sends(
                    FLOATING_REQUESTS_CONDITION,
                    "Service",
                    &service(spec.clone())
                ),
                "{spec}"
            );
        }
        // Pools and quotas always, a pool's DELETE (no object) included.
        for kind in ["FloatingIPPool", "FloatingIPProjectQuota"] {
            assert!(sends(
                FLOATING_REQUESTS_CONDITION,
                kind,
                &serde_json::Value::Null
            ));
        }
    }

    #[test]
    fn the_flat_condition_reads_each_kinds_pod_template() {
        let asking = serde_json::json!({"flatnetwork.pandaria.io/subnet": "net1"});
        let none = serde_json::json!({});
        for kind in WORKLOAD_KINDS {
            assert!(
                sends(
                    FLAT_ANNOTATIONS_CONDITION,
                    kind,
                    &carrying(kind, &asking, &none)
                ),
                "{kind}"
            );
            assert!(
                !sends(
                    FLAT_ANNOTATIONS_CONDITION,
                    kind,
                    &carrying(kind, &none, &none)
                ),
                "{kind}"
            );
        }
    }

    /// The chart's configuration, which the operator replaces with
    /// [`desired`] once it runs, sends the floating webhook the same
    /// objects.
    #[test]
    fn the_charts_floating_condition_is_the_operators() {
        let chart = include_str!("../../../charts/flatnet/templates/webhook.yaml");
        let lines: Vec<&str> = chart.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim() == "- name: floating-ip-requests-only")
            .expect("the chart's floating matchCondition");
        assert_eq!(lines[at + 1].trim(), "expression: >-");
        let indent = |l: &str| l.len() - l.trim_start().len();
        let body: Vec<&str> = lines[at + 2..]
            .iter()
            .take_while(|l| indent(l) > indent(lines[at + 1]))
            .copied()
            .collect();
        let words = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(words(&body.join(" ")), words(FLOATING_REQUESTS_CONDITION));
    }

    /// The chart's configuration as `cargo xtask charts` renders it.
    fn charts_configuration() -> serde_json::Value {
        let path = crate::allocation::fake_api::rbac::chart_render();
        let text = std::fs::read_to_string(&path).expect("the chart's render");
        let objects: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON list");
        objects
            .into_iter()
            .find(|o| o["kind"] == "ValidatingWebhookConfiguration")
            .expect("the chart renders a ValidatingWebhookConfiguration")
    }

    /// What `helm install` and `helm upgrade` send: a server-side apply of
    /// the chart's configuration, without force.
    async fn helm_applies(api: &Api<ValidatingWebhookConfiguration>) -> Result<(), kube::Error> {
        let chart = charts_configuration();
        let name = chart["metadata"]["name"].as_str().expect("a name");
        api.patch(name, &PatchParams::apply("helm"), &Patch::Apply(&chart))
            .await
            .map(drop)
    }

    #[tokio::test]
    async fn the_fake_refuses_an_apply_that_takes_another_managers_field() {
        let server = crate::allocation::fake_api::FakeApiServer::new();
        let api: Api<ValidatingWebhookConfiguration> = Api::all(server.client());
        let chart = charts_configuration();
        let name = chart["metadata"]["name"].as_str().expect("a name");
        let mut taken = chart.clone();
        taken["metadata"]["labels"][label::MANAGED_BY] = label::MANAGED_BY_FLATNET.into();
        api.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&taken),
        )
        .await
        .expect("the operator's forced apply");
        let Err(kube::Error::Api(status)) = helm_applies(&api).await else {
            panic!("helm's apply did not conflict");
        };
        assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
        assert!(
            status.message.starts_with("Apply failed with ")
                && status.message.contains(
                    "conflict with \"flatnet-operator\": .metadata.labels.app.kubernetes.io/managed-by"
                ),
            "{}",
            status.message
        );
    }

    /// Helm owns the chart's configuration, the operator only the CA bundle
    /// of each webhook: it leaves the configuration in place (same object,
    /// Helm's labels and webhooks) while writing the bundle, and a later
    /// `helm upgrade` applies without conflict and keeps the bundle.
    #[tokio::test]
    async fn the_operator_writes_only_the_ca_bundle_of_the_charts_configuration() {
        let server = crate::allocation::fake_api::FakeApiServer::new();
        let client = server.client();
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        helm_applies(&api).await.expect("helm install");
        let chart = charts_configuration();
        let name = chart["metadata"]["name"].as_str().expect("a name");
        let installed = api.get(name).await.expect("the configuration");
        let settings = WebhookSettings {
            configuration: name.to_owned(),
            ..settings(None)
        };
        let hosts = crate::tls::cert::hosts(&settings.service, &settings.namespace, None);
        crate::tls::ensure(&client, &settings, &hosts, time::OffsetDateTime::now_utc())
            .await
            .expect("the certificate upkeep");

        let injected = api.get(name).await.expect("the configuration");
        assert_eq!(
            injected.metadata.uid, installed.metadata.uid,
            "the chart's configuration was replaced"
        );
        assert_eq!(injected.labels(), installed.labels());
        assert_eq!(
            injected.labels().get(label::MANAGED_BY).map(String::as_str),
            Some("Helm")
        );
        let secret: k8s_openapi::api::core::v1::Secret =
            Api::namespaced(client.clone(), &settings.namespace)
                .get(&settings.secret)
                .await
                .expect("the webhook Secret");
        let ca = crate::tls::material_of(&secret)
            .expect("certificates")
            .ca_bundle;
        let webhooks = injected.webhooks.clone().unwrap_or_default();
        assert_eq!(webhooks.len(), 3);
        for webhook in &webhooks {
            assert_eq!(
                webhook.client_config.ca_bundle,
                Some(ByteString(ca.as_bytes().to_vec())),
                "{}",
                webhook.name
            );
        }
        // Nothing else changed: the chart's webhooks with the bundle added.
        let mut without_bundle = serde_json::to_value(&injected).expect("JSON");
        for webhook in without_bundle["webhooks"].as_array_mut().expect("webhooks") {
            webhook["clientConfig"]
                .as_object_mut()
                .expect("clientConfig")
                .remove("caBundle");
        }
        assert_eq!(without_bundle["webhooks"], chart["webhooks"]);

        helm_applies(&api)
            .await
            .expect("helm upgrade applies without conflict");
        let upgraded = api.get(name).await.expect("the configuration");
        assert_eq!(
            upgraded.webhooks, injected.webhooks,
            "the upgrade reset the bundle"
        );
    }

    #[tokio::test]
    async fn url_mode_never_takes_a_configuration_it_did_not_create() {
        let server = crate::allocation::fake_api::FakeApiServer::new();
        let client = server.client();
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        helm_applies(&api).await.expect("helm install");
        let chart = charts_configuration();
        let name = chart["metadata"]["name"].as_str().expect("a name");
        let settings = WebhookSettings {
            configuration: name.to_owned(),
            ..settings(Some("https://127.0.0.1:8443/validate"))
        };
        let error = apply_own(&client, &desired(&settings, "PEM"))
            .await
            .expect_err("a configuration Helm made");
        assert!(
            error.to_string().contains("is not the operator's (Helm)")
                && error.to_string().contains("--webhook-config"),
            "{error}"
        );
        let kept = api.get(name).await.expect("the configuration");
        assert_eq!(
            kept.labels().get(label::MANAGED_BY).map(String::as_str),
            Some("Helm")
        );
        // A name of its own: created, and applied again as its own.
        let own = WebhookSettings {
            configuration: "flatnet-dev".into(),
            ..settings
        };
        apply_own(&client, &desired(&own, "PEM"))
            .await
            .expect("created");
        apply_own(&client, &desired(&own, "PEM2"))
            .await
            .expect("its own, updated");
    }

    /// The chart renders the webhooks the operator registers out of a
    /// cluster: same names, rules, conditions, selectors and Service; the
    /// failure policy and timeout are chart values.
    #[test]
    fn the_charts_webhooks_are_the_operators() {
        let chart = charts_configuration();
        let namespace = chart["webhooks"][0]["clientConfig"]["service"]["namespace"]
            .as_str()
            .expect("a namespace")
            .to_owned();
        let service = chart["webhooks"][0]["clientConfig"]["service"]["name"]
            .as_str()
            .expect("a Service")
            .to_owned();
        let settings = WebhookSettings {
            namespace,
            service,
            ..settings(None)
        };
        let mut operators =
            serde_json::to_value(desired(&settings, "")).expect("JSON")["webhooks"].clone();
        let mut charts = chart["webhooks"].clone();
        for webhooks in [&mut operators, &mut charts] {
            for webhook in webhooks.as_array_mut().expect("webhooks") {
                let webhook = webhook.as_object_mut().expect("a webhook");
                for chart_value in ["failurePolicy", "timeoutSeconds"] {
                    webhook.remove(chart_value);
                }
                webhook["clientConfig"]
                    .as_object_mut()
                    .expect("clientConfig")
                    .remove("caBundle");
                // The expressions are folded YAML in the chart.
                for condition in webhook
                    .get_mut("matchConditions")
                    .and_then(|c| c.as_array_mut())
                    .into_iter()
                    .flatten()
                {
                    let words = condition["expression"]
                        .as_str()
                        .expect("an expression")
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ");
                    condition["expression"] = words.into();
                }
            }
        }
        assert_eq!(charts, operators);
    }

    #[test]
    fn url_mode_registers_the_url() {
        let config = desired(&settings(Some("https://127.0.0.1:8443/validate")), "PEM");
        for webhook in config.webhooks.unwrap() {
            assert!(webhook.client_config.service.is_none());
            assert_eq!(
                webhook.client_config.url.as_deref(),
                Some("https://127.0.0.1:8443/validate")
            );
        }
    }
}
