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
//!   LoadBalancer Services of flatnet's class and the pods asking for a
//!   floating address (a CEL `matchCondition`).

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
    api::{DeleteParams, ObjectMeta, Patch, PatchParams},
};

use crate::{config::WebhookSettings, flat_services::FIELD_MANAGER};
use flatnet_k8s::keys::label;

/// Path the webhooks post their reviews to.
pub const VALIDATE_PATH: &str = "/validate";
/// Name of the subnet webhook.
pub const SUBNET_WEBHOOK: &str = "subnets.flatnetwork.pandaria.io";
/// Name of the floating-address webhook.
pub const FLOATING_WEBHOOK: &str = "floating.flatnetwork.pandaria.io";
/// Sends only the Services of flatnet's `loadBalancerClass` and the pods
/// asking for a floating address (pools and quotas always), so an
/// unavailable webhook never blocks other Services or pods.
pub const FLOATING_REQUESTS_CONDITION: &str = "request.kind.kind == 'Pod' ? \
(has(object.metadata.annotations) && \
('flatnetwork.pandaria.io/floating-ip-pool' in object.metadata.annotations || \
'flatnetwork.pandaria.io/floating-ip' in object.metadata.annotations)) : \
(request.kind.kind != 'Service' || \
(has(object.spec.type) && object.spec.type == 'LoadBalancer' && \
has(object.spec.loadBalancerClass) && \
object.spec.loadBalancerClass == 'flatnetwork.pandaria.io/floating-ip'))";
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
                    // The one cluster configuration object.
                    RuleWithOperations {
                        scope: Some("Cluster".into()),
                        ..rule(
                            flatnet_k8s::api::GROUP,
                            &["v1"],
                            &["flatnetworkconfigs"],
                            &create_update,
                        )
                    },
                ],
                None,
            ),
            webhook(
                WORKLOAD_WEBHOOK,
                vec![
                    rule("", &["v1"], &["pods"], &create_update),
                    rule(
                        "apps",
                        &["v1"],
                        &["deployments", "replicasets", "statefulsets", "daemonsets"],
                        &create_update,
                    ),
                    rule("batch", &["v1"], &["jobs", "cronjobs"], &create_update),
                ],
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
                ],
                Some(vec![MatchCondition {
                    name: "floating-ip-requests-only".into(),
                    expression: FLOATING_REQUESTS_CONDITION.into(),
                }]),
            ),
        ]),
    }
}

/// Applies `desired`. A configuration of the same name that flatnet does not
/// manage (the original's, made by its deploy job with other webhook names)
/// is deleted first: server-side apply would keep its webhooks alongside ours.
///
/// # Errors
/// The API calls failed.
pub async fn apply(
    client: &Client,
    desired: &ValidatingWebhookConfiguration,
) -> Result<(), kube::Error> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let name = desired.name_any();
    if let Some(existing) = api.get_opt(&name).await? {
        let ours = existing.labels().get(label::MANAGED_BY).map(String::as_str)
            == Some(label::MANAGED_BY_FLATNET);
        if !ours {
            tracing::info!(configuration = %name, "replacing a webhook configuration flatnet does not manage");
            api.delete(&name, &DeleteParams::default()).await?;
        }
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(desired),
    )
    .await?;
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
