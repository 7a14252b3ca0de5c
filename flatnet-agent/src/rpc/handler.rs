//! The interface between the socket server and the agent's CNI logic.

use std::future::Future;

use crate::cni::{AttachRequest, CniError, CniResult, DetachRequest, GcRequest, StatusRequest};

/// The agent's implementation of the CNI commands.
///
/// Contract for implementors (the server relies on it):
///
/// - **Deadlines.** Every future may be dropped at any `.await` when the
///   request's deadline passes; the caller then gets error 102. The runtime
///   reacts to a failed ADD with DEL, so partial ADD work must be undoable by DEL.
/// - **ADD** is safe to repeat for the same container and interface
///   (runtimes retry): reuse what exists, and return the same result.
/// - **DEL is idempotent**: deleting something already gone, a container never
///   added, or a missing network namespace (`netns` is `None` or no longer
///   exists) is success. Return an error only when something that exists could
///   not be removed, because the runtime keeps retrying a failed DEL.
/// - **GC is idempotent** and never touches an attachment listed in
///   `valid_attachments`. It continues past individual failures, releases
///   what it can and reports the failures together in one error.
/// - **CHECK** compares the live state with `config.prev_result` (always set)
///   and changes nothing.
/// - **STATUS** is `Ok(())` when the agent can serve ADD now; otherwise error
///   50 ([`crate::cni::ErrorCode::PluginNotAvailable`]), or 51 when existing
///   pods may also have lost connectivity.
/// - Errors a user can cause name the object and the fix: kubelet shows `msg`
///   in the pod's events.
pub trait CniHandler: Send + Sync + 'static {
    /// ADD: create or adopt the pod interface and return the result.
    fn add(
        &self,
        request: AttachRequest,
    ) -> impl Future<Output = Result<CniResult, CniError>> + Send;

    /// CHECK: verify the attachment matches `config.prev_result`.
    fn check(&self, request: AttachRequest) -> impl Future<Output = Result<(), CniError>> + Send;

    /// DEL: remove the attachment; idempotent.
    fn del(&self, request: DetachRequest) -> impl Future<Output = Result<(), CniError>> + Send;

    /// STATUS: report readiness to serve ADD.
    fn status(&self, request: StatusRequest) -> impl Future<Output = Result<(), CniError>> + Send;

    /// GC: release everything of this network not in `valid_attachments`; idempotent.
    fn gc(&self, request: GcRequest) -> impl Future<Output = Result<(), CniError>> + Send;
}
