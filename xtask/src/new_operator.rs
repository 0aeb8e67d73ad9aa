//! `cargo xtask new-operator <name>`: a new operator crate that builds, deploys and passes its
//! own integration test with no hand edits.
//!
//! It writes, from `xtask/templates/operator/`:
//! - `crates/<name>/`: a sample CRD (`<Kind>`, `<base>.steward.dev/v1alpha1`), a reconcile
//!   (validate → build → apply → status) that keeps a ConfigMap per object, the
//!   `steward_core::operator::Definition`, a one-line `main.rs`, unit tests;
//! - `deploy/<name>/`: its ClusterRole and a kustomization using the shared `deploy/base`;
//! - `deploy/samples/<name>.yaml` and `tests/tests/<crate>.rs` (against the control plane);
//!
//! and registers it: one line in the registry's list (`crates/operators/src/lib.rs`) and its
//! dependency line (`crates/operators/Cargo.toml`); the workspace's members are `crates/*`, and
//! the tests reach the crate through the registry (`steward_operators::<crate>`).
//! Then it runs `cargo xtask crdgen` (the CRDs and the kustomizations listing the operators)
//! and `cargo xtask helm` (a fresh build of xtask, which now links the new crate).
//!
//! `<name>` is a DNS label such as `cache-operator`; without the `-operator` suffix it is the
//! base of the kind (`Cache`) and the group (`cache.steward.dev`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

/// Every name a scaffold derives from the operator's name.
#[derive(Debug, PartialEq)]
pub struct Names {
    /// `cache-operator`: binary, package, field manager, Lease, `deploy/` directory.
    pub name: String,
    /// `cache_operator`: the Rust crate.
    pub krate: String,
    /// `CacheOperator`: the `Definition`.
    pub type_: String,
    /// `Cache`: the sample CRD's kind.
    pub kind: String,
    /// `cache.steward.dev`.
    pub group: String,
}

impl Names {
    /// The names of operator `name`.
    ///
    /// # Errors
    /// When `name` is not a DNS label of at most 40 characters starting with a letter, or is
    /// only `operator`.
    pub fn of(name: &str) -> Result<Self> {
        let label = !name.is_empty()
            && name.len() <= 40
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && !name.ends_with('-')
            && !name.contains("--")
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        ensure!(
            label,
            "{name:?} is not an operator name: lowercase letters, digits and single '-', \
             starting with a letter, at most 40 characters (e.g. cache-operator)"
        );
        let base = name.strip_suffix("-operator").unwrap_or(name);
        ensure!(
            base != "operator",
            "name the operator after what it manages (e.g. cache-operator)"
        );
        let kind: String = base
            .split('-')
            .map(|part| {
                let mut chars = part.chars();
                chars.next().map_or_else(String::new, |first| {
                    first.to_ascii_uppercase().to_string() + chars.as_str()
                })
            })
            .collect();
        Ok(Self {
            name: name.to_string(),
            krate: name.replace('-', "_"),
            type_: format!("{kind}Operator"),
            group: format!("{base}.steward.dev"),
            kind,
        })
    }

    /// The sample CRD's plural: the lower-case kind plus `s` (`caches`).
    fn plural(&self) -> String {
        format!("{}s", self.kind.to_lowercase())
    }

    /// `template` with every placeholder replaced.
    fn render(&self, template: &str) -> String {
        let kind = self.kind.to_lowercase();
        template
            .replace("__name__", &self.name)
            .replace("__crate__", &self.krate)
            .replace("__Type__", &self.type_)
            .replace("__Kind__", &self.kind)
            .replace("__kind__", &kind)
            .replace("__plural__", &self.plural())
            .replace("__group__", &self.group)
    }
}

/// The files of a new operator: path (a template itself) and template.
const FILES: [(&str, &str); 9] = [
    (
        "crates/__name__/Cargo.toml",
        include_str!("../templates/operator/Cargo.toml.tmpl"),
    ),
    (
        "crates/__name__/src/main.rs",
        include_str!("../templates/operator/main.rs.tmpl"),
    ),
    (
        "crates/__name__/src/lib.rs",
        include_str!("../templates/operator/lib.rs.tmpl"),
    ),
    (
        "crates/__name__/src/crd.rs",
        include_str!("../templates/operator/crd.rs.tmpl"),
    ),
    (
        "crates/__name__/src/reconcile.rs",
        include_str!("../templates/operator/reconcile.rs.tmpl"),
    ),
    (
        "deploy/__name__/kustomization.yaml",
        include_str!("../templates/operator/kustomization.yaml.tmpl"),
    ),
    (
        "deploy/__name__/role.yaml",
        include_str!("../templates/operator/role.yaml.tmpl"),
    ),
    (
        "deploy/samples/__name__.yaml",
        include_str!("../templates/operator/sample.yaml.tmpl"),
    ),
    (
        "tests/tests/__crate__.rs",
        include_str!("../templates/operator/test.rs.tmpl"),
    ),
];

/// `cargo xtask new-operator <name>` in this workspace.
pub fn run(name: &str) -> Result<()> {
    let root = super::workspace_root();
    let names = scaffold(&root, name)?;
    // Line widths depend on the name: format what was written.
    let rust: Vec<PathBuf> = FILES
        .iter()
        .map(|(path, _)| root.join(names.render(path)))
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .collect();
    let status = std::process::Command::new("rustfmt")
        .args(["--edition", "2024"])
        .args(&rust)
        .status()
        .context("running rustfmt")?;
    ensure!(status.success(), "rustfmt failed ({status})");
    eprintln!(
        "xtask: wrote crates/{0}, deploy/{0} and its test; generating crds/ and charts/steward/",
        names.name
    );
    let status = super::cargo()
        .args(["run", "--quiet", "-p", "xtask", "--", "crdgen"])
        .status()
        .context("running cargo xtask crdgen")?;
    ensure!(status.success(), "cargo xtask crdgen failed ({status})");
    let status = super::cargo()
        .args(["run", "--quiet", "-p", "xtask", "--", "helm"])
        .status()
        .context("running cargo xtask helm")?;
    ensure!(status.success(), "cargo xtask helm failed ({status})");
    eprintln!(
        "xtask: {0} is registered. Run its test: cargo xtask test --test {1}\n\
         Start at crates/{0}/src/reconcile.rs; replace the sample spec and child with your own.",
        names.name, names.krate
    );
    Ok(())
}

/// Writes operator `name` into the workspace at `root` and registers it (no build).
///
/// # Errors
/// For an invalid name, an operator that already exists, a file of the workspace that no
/// longer has the line the registration goes after, or I/O.
pub fn scaffold(root: &Path, name: &str) -> Result<Names> {
    let names = Names::of(name)?;
    for taken in [
        format!("crates/{}", names.name),
        format!("deploy/{}", names.name),
    ] {
        ensure!(!root.join(&taken).exists(), "{taken} already exists");
    }
    // Registration first: it fails on a changed workspace before anything is written.
    let n = &names.name;
    let edits: [(&str, &str, String); 2] = [
        (
            "crates/operators/Cargo.toml",
            "= { path = \"../",
            format!("{n} = {{ path = \"../{n}\" }}"),
        ),
        (
            "crates/operators/src/lib.rs",
            "::",
            format!("    {}::{},", names.krate, names.type_),
        ),
    ];
    let edits = edits.map(|(file, anchor, line)| Edit { file, anchor, line });
    let mut edited: BTreeMap<PathBuf, String> = BTreeMap::new();
    for edit in &edits {
        let path = root.join(edit.file);
        let text = match edited.get(&path) {
            Some(text) => text.clone(),
            None => std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?,
        };
        edited.insert(path, edit.apply(&text)?);
    }
    for (path, template) in FILES {
        let path = root.join(names.render(path));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, names.render(template))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    for (path, text) in edited {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(names)
}

/// A line inserted into a file of the workspace after the last line starting with (or
/// containing) an anchor.
struct Edit {
    file: &'static str,
    anchor: &'static str,
    line: String,
}

impl Edit {
    fn apply(&self, text: &str) -> Result<String> {
        let mut lines: Vec<&str> = text.lines().collect();
        let Some(at) = lines.iter().rposition(|l| l.contains(self.anchor)) else {
            bail!(
                "{} has no line with {:?} to register the operator after; add {:?} by hand",
                self.file,
                self.anchor,
                self.line
            );
        };
        lines.insert(at + 1, &self.line);
        Ok(lines.join("\n") + "\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_from_the_operator_name() {
        assert_eq!(
            Names::of("cache-warmer-operator").unwrap(),
            Names {
                name: "cache-warmer-operator".into(),
                krate: "cache_warmer_operator".into(),
                type_: "CacheWarmerOperator".into(),
                kind: "CacheWarmer".into(),
                group: "cache-warmer.steward.dev".into(),
            }
        );
        assert_eq!(Names::of("demo").unwrap().type_, "DemoOperator");
        for bad in ["", "Demo", "1demo", "demo-", "de--mo", "de_mo", "operator"] {
            assert!(Names::of(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_line_goes_after_the_last_anchor_or_the_edit_fails() {
        let edit = Edit {
            file: "f",
            anchor: "  - ",
            line: "  - c".into(),
        };
        assert_eq!(
            edit.apply("x:\n  - a\n  - b\n").unwrap(),
            "x:\n  - a\n  - b\n  - c\n"
        );
        assert_eq!(
            edit.apply("x:\n  - a\n# end\n").unwrap(),
            "x:\n  - a\n  - c\n# end\n"
        );
        assert!(edit.apply("x: []\n").is_err());
    }

    /// The scaffold in a copy of the workspace's registration files: every edit lands once
    /// and every file is written with no placeholder left.
    #[test]
    fn scaffold_writes_and_registers_the_operator() {
        let root = tempfile::tempdir().unwrap();
        let workspace = super::super::workspace_root();
        for file in ["crates/operators/Cargo.toml", "crates/operators/src/lib.rs"] {
            let to = root.path().join(file);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(workspace.join(file), to).unwrap();
        }
        let names = scaffold(root.path(), "demo-operator").unwrap();
        assert_eq!(names.kind, "Demo");
        let read = |f: &str| std::fs::read_to_string(root.path().join(f)).unwrap();
        assert!(
            read("crates/operators/Cargo.toml")
                .ends_with("demo-operator = { path = \"../demo-operator\" }\n")
        );
        assert!(
            read("crates/operators/src/lib.rs").ends_with("    demo_operator::DemoOperator,\n}\n")
        );
        for (path, _) in FILES {
            let text = read(&names.render(path));
            assert!(!text.contains("__"), "{path} keeps a placeholder");
        }
        assert!(read("deploy/demo-operator/role.yaml").contains("resources: [\"demos/status\"]"));
        let again = scaffold(root.path(), "demo-operator").unwrap_err();
        assert!(again.to_string().contains("already exists"), "{again}");
    }
}
