//! `cargo xtask image <operator>`: an OCI image archive without a container daemon (as `ko`
//! does for Go).
//!
//! The image holds one layer: the release binary at `/usr/local/bin/<operator>`, the shared
//! libraries it links (read from `ldd`: glibc's loader, libc, libm, libgcc_s), an
//! `/etc/passwd` naming the non-root user 65532, and an empty `/tmp`. The archive is an OCI
//! image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) plus a Docker-style
//! `manifest.json`, so `docker load`, `podman load` and the test node's
//! `ctr -n k8s.io images import` accept it (written by `steward_testenv::images::OciArchive`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::json;
use steward_testenv::images;

/// What was built.
#[derive(Debug)]
pub struct Image {
    pub archive: PathBuf,
    pub reference: String,
    pub binary_size: u64,
    pub archive_size: u64,
}

/// Builds the release binary of `operator` and its image archive under `target/images/`.
pub fn run(operator: &str) -> Result<Image> {
    if steward_operators::find(operator).is_none() {
        bail!(
            "unknown operator {operator:?}; one of {}",
            steward_operators::names().join(", ")
        );
    }
    let companions = steward_operators::find(operator)
        .map(|e| e.companions)
        .unwrap_or_default();
    let mut cargo = crate::cargo();
    cargo.args(["build", "--release"]);
    for package in std::iter::once(&operator).chain(companions) {
        cargo.args(["--package", package]);
    }
    if !cargo.status()?.success() {
        bail!("cargo build --release -p {operator} failed");
    }
    let release = crate::workspace_root().join("target/release");
    let binary = release.join(operator);
    let companions: Vec<std::path::PathBuf> = companions.iter().map(|c| release.join(c)).collect();
    let out = crate::workspace_root().join("target/images");
    let image = build(
        &binary,
        &companions,
        operator,
        env!("CARGO_PKG_VERSION"),
        &out,
    )?;
    println!(
        "{}: binary {:.1} MB, image archive {:.1} MB\n  docker load -i {}   (or podman load -i …)",
        image.reference,
        image.binary_size as f64 / 1e6,
        image.archive_size as f64 / 1e6,
        image.archive.display()
    );
    Ok(image)
}

/// Writes `<out>/<name>.oci.tar` for `binary` (the image is testenv's
/// `images::operator`, which tests also run on the real node).
pub fn build(
    binary: &Path,
    companions: &[std::path::PathBuf],
    name: &str,
    version: &str,
    out: &Path,
) -> Result<Image> {
    let binary_size = std::fs::metadata(binary)
        .with_context(|| format!("{} missing", binary.display()))?
        .len();
    let reference = format!("steward/{name}:{version}");
    std::fs::create_dir_all(out)?;
    let archive = out.join(format!("{name}.oci.tar"));
    images::operator(
        binary,
        companions,
        name,
        &reference,
        labels(name, version),
        &archive,
        true,
    )?;
    let archive_size = std::fs::metadata(&archive)?.len();
    Ok(Image {
        archive,
        reference,
        binary_size,
        archive_size,
    })
}

fn labels(name: &str, version: &str) -> serde_json::Value {
    json!({
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.description": format!("Steward {name}"),
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.vendor": "Steward",
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::io::Read;
    use std::process::Command;

    use sha2::{Digest, Sha256};

    fn sha256(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    use super::*;

    /// Reads every file of a tar archive into memory.
    fn files(tar_bytes: &[u8]) -> HashMap<String, Vec<u8>> {
        let mut out = HashMap::new();
        let mut archive = tar::Archive::new(tar_bytes);
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().to_string();
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            out.insert(path, data);
        }
        out
    }

    fn blob<'a>(files: &'a HashMap<String, Vec<u8>>, descriptor: &serde_json::Value) -> &'a [u8] {
        let digest = descriptor["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let data = files
            .get(&format!("blobs/sha256/{hex}"))
            .unwrap_or_else(|| panic!("blob {digest} missing"));
        assert_eq!(sha256(data), hex, "digest of {digest}");
        assert_eq!(
            descriptor["size"].as_u64().unwrap(),
            data.len() as u64,
            "size of {digest}"
        );
        data
    }

    /// Builds an image of a real operator binary, checks every digest of the OCI layout,
    /// extracts the binary with its libraries and runs `--version` through the image's own
    /// dynamic loader.
    #[test]
    fn image_is_a_valid_oci_layout_whose_binary_runs() {
        let operator = "tenant-operator";
        // The tests' build of it (a build of the one package would compile its dependencies
        // again, with the features it alone asks for).
        let binary = steward_testenv::harness::cargo_build()
            .unwrap()
            .join(operator);
        let out = tempfile::tempdir().unwrap();
        let image = build(&binary, &[], operator, "0.0.0-test", out.path()).unwrap();

        let files = files(&std::fs::read(&image.archive).unwrap());
        assert_eq!(files["oci-layout"], br#"{"imageLayoutVersion":"1.0.0"}"#);
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifest: serde_json::Value =
            serde_json::from_slice(blob(&files, &index["manifests"][0])).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(blob(&files, &manifest["config"])).unwrap();
        assert_eq!(config["config"]["User"], "65532:65532");
        assert_eq!(
            config["config"]["Labels"]["org.opencontainers.image.title"],
            operator
        );
        let layer_gz = blob(&files, &manifest["layers"][0]);
        let mut layer = Vec::new();
        flate2::read::GzDecoder::new(layer_gz)
            .read_to_end(&mut layer)
            .unwrap();
        assert_eq!(
            config["rootfs"]["diff_ids"][0],
            format!("sha256:{}", sha256(&layer))
        );

        let root = tempfile::tempdir().unwrap();
        tar::Archive::new(layer.as_slice())
            .unpack(root.path())
            .unwrap();
        let bin = root.path().join("usr/local/bin").join(operator);
        let loader = root.path().join("lib64/ld-linux-x86-64.so.2");
        let libdir = root.path().join("lib/x86_64-linux-gnu");
        let output = Command::new(&loader)
            .arg("--library-path")
            .arg(&libdir)
            .arg(&bin)
            .arg("--version")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            stdout.contains(operator),
            "version output names the binary: {stdout}"
        );
    }
}
