//! `kubectl steward`: every Steward object on one screen, and the few things users do to them
//! by hand — approve, pause and resume an UpgradePlan, rotate a DatabaseRole's password, switch
//! a PostgresCluster's primary over, back it up now, read an operator leader's logs.
//!
//! Installed as `kubectl-steward` on the `PATH`, kubectl runs it as `kubectl steward …` and
//! passes every argument through. Start at [`Cli`] (the command line) and [`run`]:
//! [`status`] gathers objects into rows and renders them (pure, unit-tested), [`actions`]
//! decides and writes the patches, [`logs`] finds an operator's leader through its Lease.
//! Everything goes through the Kubernetes API; the operators act on what is written.

pub mod actions;
pub mod instances;
pub mod logs;
pub mod poolers;
pub mod status;

use std::io::Write;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use kube::Client;
use kube::config::{Config, KubeConfigOptions};

/// The operators, by the name each API crate gives its operator (its Lease's name): `status`
/// shows which pod leads each, `logs` reads the leader's log.
pub const OPERATORS: [&str; 3] = [
    steward_database_api::OPERATOR,
    steward_tenant_api::OPERATOR,
    steward_upgrade_api::OPERATOR,
];

/// What went wrong, named after the step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no usable kubeconfig: {0}")]
    Config(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The request makes no sense for the object as it is; nothing was changed.
    #[error("{0}")]
    Refused(String),
    #[error("write the output: {0}")]
    Output(String),
}

impl Error {
    /// A failed API call, said with what it was for.
    pub fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Api { what, source }
    }
}

/// `kubectl steward`.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl-steward",
    bin_name = "kubectl steward",
    version,
    about = "Steward's operators and their objects: status at a glance, and the actions you take by hand"
)]
pub struct Cli {
    /// Namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Every namespace (for `status`).
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// kubeconfig context (default: the current one).
    #[arg(long, global = true)]
    pub context: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Every Steward object with its readiness, and per kind what matters: a PostgresCluster's
    /// primary and lag, a Tenant's namespaces and quota, an UpgradePlan's wave and next step,
    /// and which pod leads each operator. With a PostgresCluster's name: that cluster, and
    /// each of its instances by what PostgreSQL says (connections, lag, oldest transaction,
    /// wraparound age, archiving, failing metrics queries), and with `spec.pooler` each
    /// PgBouncer pod by what its agent says (serving or paused, clients active and waiting,
    /// the longest wait, server connections, switchover pauses), read from the pods'
    /// `/metrics` through the API server (needs `get` on `pods/proxy`).
    Status {
        cluster: Option<String>,
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Approve the next wave of an UpgradePlan with `approval: Manual` (or every wave up to
    /// `--wave`).
    Approve {
        plan: String,
        #[arg(long)]
        wave: Option<i32>,
    },
    /// Pause an UpgradePlan: no component starts until `resume` (those in flight finish).
    Pause { plan: String },
    /// Resume a paused UpgradePlan.
    Resume { plan: String },
    /// Rotate a DatabaseRole's password now.
    Rotate { role: String },
    /// Rotate a PostgresCluster's CA (the new one trusted beside the old first, then
    /// signing, then alone; each phase lasts the operator's --ca-rotation-grace).
    RotateCa { cluster: String },
    /// Hand a PostgresCluster's primary to a replica (default: the ready replica that has
    /// replayed the most).
    Switchover {
        cluster: String,
        #[arg(long)]
        to: Option<String>,
    },
    /// Take a base backup of a PostgresCluster now (a PostgresBackup its primary takes; the
    /// cluster needs `spec.backup`). Default name: `<cluster>-<yyyymmddhhmmss>` (UTC).
    Backup {
        cluster: String,
        #[arg(long)]
        name: Option<String>,
    },
    /// The logs of the pod that leads an operator (the holder of its Lease).
    Logs {
        operator: String,
        /// Lines from the end.
        #[arg(long, default_value_t = 100)]
        tail: i64,
        /// Keep streaming.
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// A shell completion script, e.g. `kubectl-steward completions bash > /etc/bash_completion.d/kubectl-steward`.
    Completions { shell: clap_complete::Shell },
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

/// Runs `cli`, writing what it shows to `out`.
///
/// # Errors
/// [`Error::Config`] without a kubeconfig; [`Error::Api`] when a call fails; [`Error::Refused`]
/// when the action does not apply to the object (nothing is written then).
pub async fn run(cli: Cli, out: &mut (dyn Write + Send)) -> Result<(), Error> {
    if let Command::Completions { shell } = cli.command {
        let mut cmd = Cli::command();
        clap_complete::generate(shell, &mut cmd, "kubectl-steward", out);
        return Ok(());
    }
    let config = if cli.context.is_some() {
        let options = KubeConfigOptions {
            context: cli.context.clone(),
            ..KubeConfigOptions::default()
        };
        Config::from_kubeconfig(&options)
            .await
            .map_err(|e| Error::Config(e.to_string()))?
    } else {
        Config::infer()
            .await
            .map_err(|e| Error::Config(e.to_string()))?
    };
    let default_ns = config.default_namespace.clone();
    let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    let ns = cli.namespace.clone().unwrap_or(default_ns);
    let said = match cli.command {
        Command::Status { cluster, output } => {
            let scope = if cli.all_namespaces && cluster.is_none() {
                status::Scope::All
            } else {
                status::Scope::Namespace(ns.clone())
            };
            let mut report = status::gather(&client, &scope).await?;
            if let Some(cluster) = cluster {
                report.focus_on_cluster(&ns, &cluster)?;
                report.instances = instances::gather(&client, &ns, &cluster).await?;
                report.poolers = poolers::gather(&client, &ns, &cluster).await?;
            }
            match output {
                Output::Table => status::render(&report, &scope),
                Output::Json => serde_json::to_string_pretty(&report)
                    .map(|s| s + "\n")
                    .map_err(|e| Error::Output(e.to_string()))?,
                Output::Yaml => {
                    serde_yaml::to_string(&report).map_err(|e| Error::Output(e.to_string()))?
                }
            }
        }
        Command::Approve { plan, wave } => actions::approve(&client, &ns, &plan, wave).await?,
        Command::Pause { plan } => actions::set_paused(&client, &ns, &plan, true).await?,
        Command::Resume { plan } => actions::set_paused(&client, &ns, &plan, false).await?,
        Command::Rotate { role } => actions::rotate(&client, &ns, &role).await?,
        Command::RotateCa { cluster } => actions::rotate_ca(&client, &ns, &cluster).await?,
        Command::Switchover { cluster, to } => {
            actions::switchover(&client, &ns, &cluster, to.as_deref()).await?
        }
        Command::Backup { cluster, name } => {
            actions::backup(&client, &ns, &cluster, name.as_deref()).await?
        }
        Command::Logs {
            operator,
            tail,
            follow,
        } => {
            let explicit = cli.namespace.as_deref();
            return logs::leader_logs(&client, explicit, &operator, tail, follow, out).await;
        }
        // Written above, before any client was made.
        Command::Completions { .. } => String::new(),
    };
    out.write_all(said.as_bytes())
        .map_err(|e| Error::Output(e.to_string()))
}
