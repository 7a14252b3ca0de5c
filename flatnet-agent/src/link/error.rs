//! Errors of the attachment layer.

use std::{io, path::PathBuf};

use crate::{netns::NetnsError, packet::RawSocketError};

/// An attachment could not be validated, created, checked or removed.
///
/// Every variant names the object involved; errors a user can cause also
/// say what to fix. Kernel errors keep their errno ([`LinkError::errno`]) so
/// callers can map `EEXIST`, `ENOENT`, `EBUSY`...
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The spec breaks a rule; nothing was touched.
    #[error("invalid attachment for subnet {subnet}: {field}: {reason}")]
    InvalidSpec {
        /// The subnet the spec comes from.
        subnet: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The subnet's master interface does not exist on this node.
    #[error("master interface {master} not found on this node; fix spec.master of subnet {subnet}")]
    MasterNotFound {
        /// The missing interface.
        master: String,
        /// The subnet naming it.
        subnet: String,
    },
    /// What had to hold before the interface came up did not (ADD's
    /// conflict verdict); what the attach made is removed.
    #[error("the attach of {ifname} was stopped before the interface came up")]
    StoppedBeforeUp {
        /// The interface name.
        ifname: String,
    },
    /// The pod already has an interface of that name.
    #[error(
        "interface {ifname} already exists in network namespace {netns}; \
         remove it or attach under another interface name"
    )]
    AlreadyExists {
        /// The interface name.
        ifname: String,
        /// The pod's namespace.
        netns: String,
    },
    /// The requested MTU is above the parent's.
    #[error(
        "MTU {mtu} of subnet {subnet} is larger than the MTU {parent_mtu} of {parent}; \
         lower the subnet's MTU or raise the parent's"
    )]
    MtuTooLarge {
        /// The subnet.
        subnet: String,
        /// The requested MTU.
        mtu: u32,
        /// The parent interface.
        parent: String,
        /// Its MTU.
        parent_mtu: u32,
    },
    /// The pod's interface of that name is not the child flatnet made.
    #[error(
        "interface {ifname} in network namespace {netns} is not a macvlan/ipvlan child of {parent}; \
         flatnet leaves it alone: remove or rename it if flatnet should manage it"
    )]
    NotOurs {
        /// The interface name.
        ifname: String,
        /// The pod's namespace.
        netns: String,
        /// The parent flatnet attached it to.
        parent: String,
    },
    /// The kernel does not support a link kind flatnet needs.
    #[error(
        "the kernel of this node lacks {kind} support (load the {module} module), needed by subnet {subnet}"
    )]
    Unsupported {
        /// The link kind (`ipvlan`, `802.1Q VLAN`).
        kind: &'static str,
        /// The kernel module providing it.
        module: &'static str,
        /// The subnet that needs it.
        subnet: String,
    },
    /// The pod's primary interface has no default gateway to route through.
    #[error(
        "interface {ifname} in network namespace {netns} has no {family} default route, \
         so {destination} cannot be routed through it; remove it from the primary routes \
         or give the primary network a gateway"
    )]
    NoPrimaryGateway {
        /// The primary interface.
        ifname: String,
        /// The pod's namespace.
        netns: String,
        /// `IPv4` or `IPv6`.
        family: &'static str,
        /// The destination that needed it.
        destination: String,
    },
    /// A subnet route names a pod interface that does not exist.
    #[error(
        "route {destination} of subnet {subnet} goes through dev {dev}, which does not exist \
         in network namespace {netns}; fix the route's dev in spec.routes (the flat interface \
         or an interface the pod has, such as eth0)"
    )]
    RouteDevNotFound {
        /// The missing interface.
        dev: String,
        /// The route's destination.
        destination: String,
        /// The pod's namespace.
        netns: String,
        /// The subnet.
        subnet: String,
    },
    /// `addPodIPToHost`: the node cannot reach the pod's primary interface.
    #[error(
        "cannot route the node to the pod through {ifname} in network namespace {netns}: \
         {reason}; turn off routeSettings.addPodIPToHost or fix the primary network"
    )]
    NoPathToPrimary {
        /// The primary interface in the pod.
        ifname: String,
        /// The pod's namespace.
        netns: String,
        /// What is missing.
        reason: String,
    },
    /// A netlink request failed.
    #[error("{op} {object} in network namespace {netns}: {source}")]
    Netlink {
        /// What was attempted (`create macvlan`, `add route`, ...).
        op: &'static str,
        /// The object (interface, address, route).
        object: String,
        /// The namespace the request went to.
        netns: String,
        /// The errno, when the kernel returned one.
        errno: Option<i32>,
        /// The netlink error (boxed: it can hold a whole netlink message).
        #[source]
        source: Box<rtnetlink::Error>,
    },
    /// A netlink socket could not be opened.
    #[error("cannot open a netlink socket in network namespace {netns}: {source}")]
    Socket {
        /// The namespace.
        netns: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A network namespace could not be entered.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A file operation failed (sysctl, VLAN lease, lock).
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Announcing the pod's addresses failed.
    #[error("cannot announce the addresses of {ifname} in network namespace {netns}: {source}")]
    Announce {
        /// The pod interface.
        ifname: String,
        /// The pod's namespace.
        netns: String,
        /// The socket error.
        #[source]
        source: RawSocketError,
    },
    /// The interface to check does not exist.
    #[error("interface {ifname} not found in network namespace {netns}")]
    NotFound {
        /// The interface.
        ifname: String,
        /// The namespace.
        netns: String,
    },
    /// The interface exists but differs from the spec.
    #[error(
        "interface {ifname} in network namespace {netns} does not match subnet {subnet}: {}",
        differences.join("; ")
    )]
    Mismatch {
        /// The interface.
        ifname: String,
        /// The namespace.
        netns: String,
        /// The subnet.
        subnet: String,
        /// Each difference, as `what: expected X, found Y`.
        differences: Vec<String>,
    },
    /// Several independent steps failed (teardown carries on after an error).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Multiple(Vec<LinkError>),
}

impl LinkError {
    /// The kernel errno behind this error, if any (positive, e.g. `libc::EEXIST`).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Netlink { errno, .. } => *errno,
            Self::AlreadyExists { .. } => Some(libc::EEXIST),
            Self::NotFound { .. } | Self::MasterNotFound { .. } => Some(libc::ENODEV),
            Self::Unsupported { .. } => Some(libc::EOPNOTSUPP),
            Self::Socket { source, .. } | Self::Io { source, .. } => source.raw_os_error(),
            Self::Multiple(errors) => errors.iter().find_map(Self::errno),
            _ => None,
        }
    }

    /// Builds [`LinkError::Netlink`], extracting the errno.
    pub(crate) fn netlink(
        op: &'static str,
        object: impl Into<String>,
        netns: impl Into<String>,
        source: rtnetlink::Error,
    ) -> Self {
        Self::Netlink {
            op,
            object: object.into(),
            netns: netns.into(),
            errno: errno_of(&source),
            source: Box::new(source),
        }
    }

    /// Folds a list of errors from independent steps into one result.
    pub(crate) fn collect(mut errors: Vec<LinkError>) -> Result<(), LinkError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(Self::Multiple(errors)),
        }
    }
}

/// The positive errno of a netlink error, if it carries one.
pub(crate) fn errno_of(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(msg) if msg.raw_code() != 0 => Some(msg.raw_code().abs()),
        _ => None,
    }
}
