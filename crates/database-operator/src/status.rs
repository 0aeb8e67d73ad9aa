//! Status shared by the Database and DatabaseRole controllers: the `ServerReachable`
//! condition, `Ready`, and the phase (`server_status`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use steward_core::ReconcileError;
use steward_core::conditions::{self, READY};

use crate::Error;
use crate::crd::ResourcePhase;

/// Condition: whether the server could be reached at the last attempt.
pub const SERVER_REACHABLE: &str = "ServerReachable";

/// The part of a Database's and a DatabaseRole's status that both share: `ServerReachable`
/// from what the reconcile saw of the server (left as it was if it never got that far),
/// `Ready` from the reconcile's result (`ready_message` on success), and the phase.
pub(crate) fn server_status(
    conds: &mut Vec<Condition>,
    reachable: &Option<Result<(), String>>,
    result: Result<(), &Error>,
    deleting: bool,
    ready_message: String,
    generation: Option<i64>,
) -> ResourcePhase {
    match reachable {
        Some(Ok(())) => {
            conditions::set(
                conds,
                SERVER_REACHABLE,
                true,
                "Connected",
                "connected and logged in",
                generation,
            );
        }
        Some(Err(why)) => {
            conditions::set(
                conds,
                SERVER_REACHABLE,
                false,
                "ServerUnreachable",
                why.clone(),
                generation,
            );
        }
        None => {}
    }
    match &result {
        Ok(()) => conditions::set(conds, READY, true, "Converged", ready_message, generation),
        Err(e) => conditions::failed(conds, *e, generation),
    };
    match (&result, deleting) {
        (_, true) => ResourcePhase::Deleting,
        (Ok(()), false) => ResourcePhase::Ready,
        (Err(e), false) if e.is_permanent() => ResourcePhase::Failed,
        (Err(_), false) => ResourcePhase::Pending,
    }
}
