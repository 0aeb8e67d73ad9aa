//! The operator contract: what an operator crate implements once ([`Definition`]), the whole
//! `main` steward-core runs for it ([`main`]), and the entry xtask's registry lists
//! ([`Entry`]).
//!
//! An operator crate is its CRD types, its reconcile logic and one `impl Definition`; its
//! binary is one line:
//!
//! ```no_run
//! # mod my_operator {
//! #     pub struct MyOperator;
//! #     #[derive(clap::Args, Clone, Debug)]
//! #     pub struct Options {}
//! #     impl steward_core::operator::Definition for MyOperator {
//! #         const NAME: &'static str = "my-operator";
//! #         const ABOUT: &'static str = "Does things";
//! #         type Options = Options;
//! #         type Error = std::convert::Infallible;
//! #         fn crds() -> Vec<steward_core::k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> { vec![] }
//! #         fn register(_: &mut steward_core::Operator, _: Options) -> Result<(), Self::Error> { Ok(()) }
//! #     }
//! # }
//! fn main() -> std::process::ExitCode {
//!     steward_core::operator::main::<my_operator::MyOperator>()
//! }
//! ```

use std::process::ExitCode;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

use crate::Operator;
use crate::cli::CommonArgs;

/// What an operator crate tells steward-core about itself.
pub trait Definition: 'static {
    /// The operator's name: its binary, field manager, Lease, Event reporter and deploy/ dir.
    const NAME: &'static str;
    /// One line for `--help`.
    const ABOUT: &'static str;
    /// Other binaries of the workspace shipped in the operator's image next to it (package
    /// and binary of the same name, at `/usr/local/bin/<name>`): the database-operator's
    /// PostgreSQL instance manager, which its pods copy from the image.
    const COMPANIONS: &'static [&'static str] = &[];
    /// The files of `deploy/samples/` with this operator's sample objects, in the order they
    /// are applied (an object a sample refers to first): `cargo xtask crdgen` lists them in the
    /// samples kustomization.
    const SAMPLES: &'static [&'static str] = &[];
    /// The operator's own flags, next to [`CommonArgs`]. Give it `Default` with
    /// [`crate::cli::defaults`], so the defaults come from the flag definitions.
    type Options: clap::Args + clap::FromArgMatches + Clone + Send + 'static;
    /// Why [`Definition::register`] refused the options.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Every CustomResourceDefinition this operator owns (`cargo xtask crdgen` writes them).
    fn crds() -> Vec<CustomResourceDefinition>;

    /// Adds the operator's controllers (and anything else it runs) to `operator`.
    ///
    /// # Errors
    /// When `options` cannot be used; the binary then exits with the message.
    fn register(operator: &mut Operator, options: Self::Options) -> Result<(), Self::Error>;

    /// Something to print instead of running (such as generated manifests), decided from the
    /// flags; `None` (the default) runs the operator.
    ///
    /// # Errors
    /// When what was asked for cannot be produced.
    fn print_instead(options: &Self::Options) -> Result<Option<String>, Self::Error> {
        let _ = options;
        Ok(None)
    }

    /// Manifests generated from the code into `deploy/<NAME>/`, by file name (`cargo xtask
    /// crdgen` writes them, its `--check` fails when one is stale): objects the operator needs
    /// in force but must not be able to write itself, installed with its deployment (list
    /// them in its kustomization). The tenant-operator's MutatingAdmissionPolicy is one: a
    /// ServiceAccount that may write a mutating policy may rewrite any object of the cluster.
    ///
    /// # Errors
    /// When a manifest cannot be serialized.
    fn manifests() -> Result<Manifests, String> {
        Ok(Vec::new())
    }
}

/// What every Steward CRD has, so that `kubectl get steward` lists it and `kubectl get <kind>`
/// says how each object is: the category `steward`, the status subresource (one status write
/// per reconcile goes there), an `Age` column and a `Ready` or `Phase` column. Returns what
/// `crd` misses, one sentence each (empty: it follows them all).
pub fn crd_conventions(crd: &CustomResourceDefinition) -> Vec<String> {
    let mut missed = Vec::new();
    let names = &crd.spec.names;
    if !names.categories.iter().flatten().any(|c| c == "steward") {
        missed.push("not in the category `steward`".to_string());
    }
    for version in &crd.spec.versions {
        let v = &version.name;
        if version
            .subresources
            .as_ref()
            .and_then(|s| s.status.as_ref())
            .is_none()
        {
            missed.push(format!("{v}: no status subresource"));
        }
        let columns: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        if !columns.contains(&"Age") {
            missed.push(format!("{v}: no Age column"));
        }
        if !columns.iter().any(|c| *c == "Ready" || *c == "Phase") {
            missed.push(format!("{v}: neither a Ready nor a Phase column"));
        }
    }
    missed
}

/// Generated manifests by file name ([`Definition::manifests`]).
pub type Manifests = Vec<(&'static str, String)>;

/// An operator as the workspace's registry lists it: what xtask and the tests need without
/// knowing its types.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// [`Definition::NAME`].
    pub name: &'static str,
    /// [`Definition::crds`].
    pub crds: fn() -> Vec<CustomResourceDefinition>,
    /// Parses the operator's whole command line (the arguments after the binary's name), as
    /// its binary would, returning the common flags: for checking manifests that run it.
    pub parse_args: fn(&[String]) -> Result<CommonArgs, clap::Error>,
    /// [`Definition::COMPANIONS`].
    pub companions: &'static [&'static str],
    /// [`Definition::SAMPLES`].
    pub samples: &'static [&'static str],
    /// [`Definition::manifests`].
    pub manifests: fn() -> Result<Manifests, String>,
    /// Registers the operator on `operator` with its options parsed from a command line (the
    /// arguments after the binary's name; none: the defaults), as its binary would: for tests
    /// and tools that need every operator's controllers or metrics.
    pub register: fn(&mut Operator, &[String]) -> Result<(), String>,
}

impl Entry {
    /// The entry of operator `D`.
    pub fn of<D: Definition>() -> Self {
        Self {
            name: D::NAME,
            crds: D::crds,
            parse_args: parse_args::<D>,
            companions: D::COMPANIONS,
            samples: D::SAMPLES,
            manifests: D::manifests,
            register: register::<D>,
        }
    }
}

fn register<D: Definition>(operator: &mut Operator, args: &[String]) -> Result<(), String> {
    let cli = parse::<D>(args).map_err(|e| e.to_string())?;
    D::register(operator, cli.options).map_err(|e| e.to_string())
}

/// `D`'s command line parsed from `args` (those after the binary's name), as its binary would.
fn parse<D: Definition>(args: &[String]) -> Result<Cli<D::Options>, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let argv = std::iter::once(D::NAME.to_string()).chain(args.iter().cloned());
    let matches = Cli::<D::Options>::command()
        .name(D::NAME)
        .try_get_matches_from(argv)?;
    Cli::<D::Options>::from_arg_matches(&matches)
}

fn parse_args<D: Definition>(args: &[String]) -> Result<CommonArgs, clap::Error> {
    Ok(parse::<D>(args)?.common)
}

#[derive(clap::Parser)]
struct Cli<O: clap::Args> {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    options: O,
}

/// The whole `main` of operator `D`: parses [`CommonArgs`] and `D::Options`, sets up logging,
/// connects, registers `D`'s controllers and runs until SIGTERM/SIGINT (see
/// [`Operator::run`]). Errors are printed with their causes; the exit code is 1.
pub fn main<D: Definition>() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};

    let command = Cli::<D::Options>::command()
        .name(D::NAME)
        .bin_name(D::NAME)
        .about(D::ABOUT)
        .version(env!("CARGO_PKG_VERSION"));
    let cli = match Cli::<D::Options>::from_arg_matches(&command.get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match D::print_instead(&cli.options) {
        Ok(Some(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => return fail(D::NAME, &e),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return fail(D::NAME, &e),
    };
    let telemetry = match runtime.block_on(async { crate::telemetry::init(&cli.common, D::NAME) }) {
        Ok(telemetry) => telemetry,
        Err(e) => return fail(D::NAME, &e),
    };
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = runtime.block_on(async {
        let mut operator = Operator::new(D::NAME, cli.common).await?;
        D::register(&mut operator, cli.options)?;
        operator.run().await?;
        Ok(())
    });
    // Outside the runtime: flushing the last spans blocks.
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(D::NAME, e.as_ref()),
    }
}

fn fail(name: &str, err: &(dyn std::error::Error + 'static)) -> ExitCode {
    eprintln!("{name}: {}", crate::chain(err));
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CRD without the conventions is told each one it misses.
    #[test]
    fn a_bare_crd_misses_every_convention() {
        let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "things.example.dev"},
            "spec": {"group": "example.dev", "scope": "Namespaced",
                     "names": {"kind": "Thing", "plural": "things"},
                     "versions": [{"name": "v1", "served": true, "storage": true}]}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            crd_conventions(&crd),
            [
                "not in the category `steward`",
                "v1: no status subresource",
                "v1: no Age column",
                "v1: neither a Ready nor a Phase column"
            ]
        );
    }

    #[derive(clap::Args, Clone, Debug, PartialEq)]
    struct Options {
        /// A flag with a default.
        #[arg(long, default_value = "7")]
        level: u32,
    }

    struct Demo;

    impl Definition for Demo {
        const NAME: &'static str = "demo-operator";
        const ABOUT: &'static str = "A demo";
        type Options = Options;
        type Error = std::convert::Infallible;
        fn crds() -> Vec<CustomResourceDefinition> {
            Vec::new()
        }
        fn register(_: &mut Operator, _: Options) -> Result<(), Self::Error> {
            Ok(())
        }
    }

    #[test]
    fn the_command_has_the_common_flags_and_the_operators_own() {
        use clap::{CommandFactory, FromArgMatches};
        let command = Cli::<Options>::command().name(Demo::NAME);
        let matches = command
            .try_get_matches_from(["demo-operator", "--level", "3", "--leader-elect=false"])
            .expect("parses");
        let cli = Cli::<Options>::from_arg_matches(&matches).expect("typed");
        assert_eq!(cli.options, Options { level: 3 });
        assert!(!cli.common.leader_elect);
        let entry = Entry::of::<Demo>();
        assert_eq!(entry.name, "demo-operator");
        let parsed = (entry.parse_args)(&["--level=2".into(), "--leader-elect=false".into()]);
        assert!(parsed.is_ok_and(|common| !common.leader_elect));
        assert!((entry.parse_args)(&["--no-such-flag".into()]).is_err());
        assert_eq!(crate::cli::defaults::<Options>(), Options { level: 7 });
    }
}
