//! Reconcile failures of the allocation controllers.

use crate::controller::ApiError;
pub(crate) use crate::controller::{CONFLICT_RETRY, is_conflict, is_not_found};
use flatnet_k8s::{
    annotations::AnnotationError,
    ipam::{MacPoolExhausted, MacsTaken, PoolError},
};

/// A reconcile failure. The message names the object and, for what a user
/// causes, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error(transparent)]
    Kube(#[from] ApiError),
    /// The pod's annotations cannot be used.
    #[error("pod {pod}: {source}")]
    Annotation {
        /// `namespace/name` of the pod.
        pod: String,
        /// What is wrong and the fix.
        #[source]
        source: AnnotationError,
    },
    /// The pod's name is too long for its dual-stack record name.
    #[error(
        "pod {pod}: the name is too long for its IPv6 record {pod}.ipv6 (253 characters at most): shorten the pod name by 5 characters"
    )]
    NameTooLong {
        /// `namespace/name` of the pod.
        pod: String,
    },
    /// The requested subnet does not exist.
    #[error(
        "FlatNetworkSubnet {subnet} does not exist in cattle-flat-network: create it or fix the flatnetwork.pandaria.io/subnet annotation"
    )]
    SubnetMissing {
        /// The subnet name.
        subnet: String,
    },
    /// The subnet exists but cannot allocate.
    #[error("FlatNetworkSubnet {subnet} is not ready ({reason}): fix the subnet first")]
    SubnetNotReady {
        /// The subnet name.
        subnet: String,
        /// Why.
        reason: String,
    },
    /// The subnet has the wrong family for its place in a dual-stack pair.
    #[error(
        "FlatNetworkSubnet {subnet} is {actual} but is named as the {expected} subnet in flatnetwork.pandaria.io/subnet: write \"v4name,v6name\""
    )]
    WrongFamily {
        /// The subnet name.
        subnet: String,
        /// Its family.
        actual: &'static str,
        /// The family its position asks for.
        expected: &'static str,
    },
    /// No address can be allocated.
    #[error("{0}")]
    Pool(#[from] PoolError),
    /// No MAC can be chosen.
    #[error("{0}")]
    Mac(#[from] MacsTaken),
    /// The MAC pool has no MAC left on the parent link.
    #[error("{0}")]
    MacPool(#[from] MacPoolExhausted),
    /// The subnet's ledger could not be written.
    #[error("update status of FlatNetworkSubnet {subnet}: {message}")]
    LedgerWrite {
        /// The subnet name.
        subnet: String,
        /// The API error.
        message: String,
    },
    /// Other writers kept changing the subnet; retried later.
    #[error("FlatNetworkSubnet {subnet} changed under every one of {attempts} attempts; retrying")]
    Contention {
        /// The subnet name.
        subnet: String,
        /// Attempts made.
        attempts: u32,
    },
    /// Other writers kept changing the MAC ledger; retried later.
    #[error(
        "the fixed-MAC ledger of {parent} changed under every one of {attempts} attempts; retrying"
    )]
    MacLedgerContention {
        /// The parent link.
        parent: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The MAC ledger of a parent link could not be written.
    #[error("write the MAC ledger of {parent}: {message}")]
    MacLedgerWrite {
        /// The parent link.
        parent: String,
        /// The API error.
        message: String,
    },
    /// The reservation got too old to be written safely; retried later.
    #[error(
        "the address reserved for FlatNetworkIP {record} was not written within {deadline:?}; left to the subnet repair, retrying"
    )]
    ReservationExpired {
        /// `namespace/name` of the record.
        record: String,
        /// The write deadline.
        deadline: std::time::Duration,
    },
}

impl Error {
    /// Short error kind for the `error` label of the error counter.
    #[must_use]
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(_) | Self::LedgerWrite { .. } | Self::MacLedgerWrite { .. } => "kube_api",
            Self::Annotation { .. } | Self::NameTooLong { .. } => "bad_annotation",
            Self::SubnetMissing { .. } => "subnet_missing",
            Self::SubnetNotReady { .. } | Self::WrongFamily { .. } => "subnet_not_ready",
            Self::Pool(PoolError::Exhausted { .. }) => "exhausted",
            Self::Pool(PoolError::CandidatesTaken { .. }) => "requested_taken",
            Self::Pool(PoolError::Reserved { .. }) => "requested_reserved",
            Self::Pool(PoolError::LiveOnWire { .. }) => "requested_live_on_wire",
            Self::Pool(_) => "bad_request",
            Self::Mac(_) => "mac_taken",
            Self::MacPool(_) => "mac_pool_exhausted",
            Self::Contention { .. } | Self::MacLedgerContention { .. } => "contention",
            Self::ReservationExpired { .. } => "reservation_expired",
        }
    }

    /// Whether only a user can fix it (an Event says how); such errors are
    /// retried slowly, the others with backoff.
    #[must_use]
    pub fn needs_user(&self) -> bool {
        !matches!(
            self,
            Self::Kube(_)
                | Self::LedgerWrite { .. }
                | Self::Contention { .. }
                | Self::MacLedgerContention { .. }
                | Self::ReservationExpired { .. }
        )
    }

    /// The Event reason for a user-caused error.
    #[must_use]
    pub fn event_reason(&self) -> &'static str {
        match self {
            Self::Pool(PoolError::Exhausted { .. }) => "NoAddressLeft",
            Self::Pool(PoolError::CandidatesTaken { .. }) => "RequestedAddressTaken",
            Self::Pool(PoolError::Reserved { .. }) => "RequestedAddressReserved",
            Self::Pool(PoolError::LiveOnWire { .. }) => "RequestedAddressLiveOnWire",
            Self::Mac(_) => "RequestedMacTaken",
            Self::MacPool(_) => "NoMacLeft",
            Self::Annotation { .. } | Self::NameTooLong { .. } => "InvalidAnnotation",
            Self::SubnetMissing { .. } => "SubnetMissing",
            _ => super::events::ALLOCATION_ERROR_REASON,
        }
    }

    pub(crate) fn kube(
        op: &'static str,
        kind: &str,
        key: &str,
    ) -> impl FnOnce(kube::Error) -> Self {
        let api_error = ApiError::of(op, kind, key);
        move |source| Self::Kube(api_error(source))
    }
}
