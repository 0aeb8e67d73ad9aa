//! `kubectl steward logs <operator>`: the operator's leader is the holder of the Lease named
//! after the operator (steward-core's leader election; the identity is `<pod>_<random>`), so
//! the logs worth reading are that pod's.

use std::io::Write;

use futures::{AsyncBufReadExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, LogParams};
use kube::{Client, ResourceExt};

use crate::Error;

/// The pod named by a Lease holder identity, `<pod>_<random>`.
pub fn holder_pod(identity: &str) -> Option<&str> {
    identity.split('_').next().filter(|pod| !pod.is_empty())
}

/// Finds `operator`'s Lease (in `namespace`, or in every namespace when `None`) and returns
/// its namespace and leader pod.
///
/// # Errors
/// [`Error::Refused`] when there is no such Lease, several in different namespaces (say
/// which with `-n`), or nobody holds it.
pub async fn leader(
    client: &Client,
    namespace: Option<&str>,
    operator: &str,
) -> Result<(String, String), Error> {
    let leases: Vec<Lease> = match namespace {
        Some(ns) => Api::<Lease>::namespaced(client.clone(), ns)
            .get_opt(operator)
            .await
            .map_err(Error::api(format!("get lease {operator} in {ns}")))?
            .into_iter()
            .collect(),
        None => {
            Api::<Lease>::all(client.clone())
                .list(&ListParams::default().fields(&format!("metadata.name={operator}")))
                .await
                .map_err(Error::api(format!("list leases named {operator}")))?
                .items
        }
    };
    let lease = match leases.as_slice() {
        [] => {
            let known = crate::OPERATORS.join(", ");
            return Err(Error::Refused(format!(
                "no Lease named {operator}{}: is the operator running with leader election? (operators: {known})",
                namespace.map(|ns| format!(" in {ns}")).unwrap_or_default()
            )));
        }
        [lease] => lease,
        many => {
            let namespaces: Vec<String> = many.iter().filter_map(|l| l.namespace()).collect();
            return Err(Error::Refused(format!(
                "{operator} runs in several namespaces ({}): say which with -n",
                namespaces.join(", ")
            )));
        }
    };
    let ns = lease.namespace().unwrap_or_default();
    let identity = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default();
    let pod = holder_pod(&identity).ok_or_else(|| {
        Error::Refused(format!(
            "nobody holds the Lease {ns}/{operator}: no leader now"
        ))
    })?;
    Ok((ns, pod.to_string()))
}

/// Writes the leader's last `tail` log lines to `out` (and, with `follow`, what it logs next).
///
/// # Errors
/// As [`leader`]; [`Error::Api`] when the logs cannot be read.
pub async fn leader_logs(
    client: &Client,
    namespace: Option<&str>,
    operator: &str,
    tail: i64,
    follow: bool,
    out: &mut (dyn Write + Send),
) -> Result<(), Error> {
    let (ns, pod) = leader(client, namespace, operator).await?;
    eprintln!("# {operator}: leader {pod} in {ns}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let params = LogParams {
        tail_lines: Some(tail),
        follow,
        ..LogParams::default()
    };
    let what = format!("read the logs of pod {pod} in {ns}");
    let mut lines = pods
        .log_stream(&pod, &params)
        .await
        .map_err(Error::api(what.clone()))?
        .lines();
    while let Some(line) = lines
        .try_next()
        .await
        .map_err(|e| Error::Output(format!("{what}: {e}")))?
    {
        writeln!(out, "{line}").map_err(|e| Error::Output(e.to_string()))?;
    }
    Ok(())
}
