//! Errors of a reconcile, named after the step that failed.

/// Why a reconcile of an `UpgradePlan` failed. All are transient (retried with backoff):
/// an invalid plan is not an error but `Valid=False` in its status.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plan has no namespace (cannot happen for a namespaced kind).
    #[error("failed to read the plan: UpgradePlan {0} has no namespace")]
    NoNamespace(String),
    /// Reading a target failed.
    #[error("failed to read {kind} {name}")]
    ReadTarget {
        kind: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// The recorded change does not fit the target as read.
    #[error("failed to build the change of {kind} {name}: {message}")]
    BuildChange {
        kind: String,
        name: String,
        message: String,
    },
    /// Changing (or reverting) a target failed; a failed `test` operation means someone else
    /// changed the value meanwhile.
    #[error("failed to change {kind} {name} from {from:?} to {to:?}")]
    ChangeTarget {
        kind: String,
        name: String,
        from: String,
        to: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// Reading the plan itself (to confirm the cached copy is current) failed.
    #[error("failed to read UpgradePlan {name}")]
    ReadPlan {
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// Listing the plan's hook Jobs failed.
    #[error("failed to list the hook Jobs of UpgradePlan {name}")]
    ReadHooks {
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// The recorded hook does not fit the spec (its component has no such hook).
    #[error("failed to build hook Job {job}: {message}")]
    BuildHook { job: String, message: String },
    /// Creating a hook's Job failed.
    #[error("failed to create hook Job {job}")]
    CreateHook {
        job: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// Reading the plan's ServiceAccount (whether it delegates to the plan) failed.
    #[error("failed to read ServiceAccount {account}")]
    ReadServiceAccount {
        account: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// A client acting as the plan's ServiceAccount could not be built.
    #[error("failed to act as ServiceAccount {account}")]
    Impersonate {
        account: String,
        #[source]
        source: Box<steward_core::Error>,
    },
    /// Writing the plan's status failed.
    #[error("failed to write the status of UpgradePlan {name}")]
    WriteStatus {
        name: String,
        #[source]
        source: Box<steward_core::Error>,
    },
}

impl steward_core::ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::NoNamespace(_) => "InvalidObject",
            Error::ReadTarget { .. } => "ReadTargetFailed",
            Error::BuildChange { .. } => "BuildChangeFailed",
            Error::ChangeTarget { .. } => "ChangeTargetFailed",
            Error::ReadPlan { .. } => "ReadPlanFailed",
            Error::ReadHooks { .. } => "ReadHooksFailed",
            Error::BuildHook { .. } => "BuildHookFailed",
            Error::CreateHook { .. } => "CreateHookFailed",
            Error::ReadServiceAccount { .. } => "ReadServiceAccountFailed",
            Error::Impersonate { .. } => "ImpersonateFailed",
            Error::WriteStatus { .. } => "WriteStatusFailed",
        }
    }

    fn is_permanent(&self) -> bool {
        matches!(self, Error::NoNamespace(_))
    }
}
