//! Generated passwords and the SCRAM-SHA-256 verifiers PostgreSQL stores for them.
//!
//! The operator never sends a password to the server in clear text: `CREATE ROLE … PASSWORD`
//! gets the SCRAM verifier computed here, so the password cannot show up in the server's
//! statement log or `pg_stat_activity`. The verifier PostgreSQL stored is checked against the
//! password in the Secret on every reconcile ([`verifies`]), so a password changed by hand is
//! set back.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use rand::Rng;
use sha2::{Digest, Sha256};

/// The URL-safe alphabet of generated passwords (64 symbols: 6 bits each).
pub const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// Length of generated passwords: 32 × 6 = 192 bits of entropy.
pub const LENGTH: usize = 32;

const ITERATIONS: u32 = 4096;

/// A password. Its `Debug` and `Display` print `<redacted>`, so it cannot leak into logs,
/// Events or error messages by formatting.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    /// A new random password from the OS-seeded CSPRNG: [`LENGTH`] characters of [`ALPHABET`].
    pub fn generate() -> Self {
        let mut rng = rand::rng();
        Self(
            (0..LENGTH)
                .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
                .collect(),
        )
    }

    /// Wraps an existing password (read from a Secret).
    pub fn from_existing(value: String) -> Self {
        Self(value)
    }

    /// The password itself, for Secrets and for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A SCRAM-SHA-256 verifier with a random salt, as PostgreSQL stores in `pg_authid`.
    pub fn scram_verifier(&self) -> String {
        let mut salt = [0u8; 16];
        rand::rng().fill(&mut salt);
        scram_verifier_with_salt(self.0.as_bytes(), &salt, ITERATIONS)
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>` (RFC 5802/7677). Generated
/// passwords are ASCII, for which SASLprep is the identity.
pub fn scram_verifier_with_salt(password: &[u8], salt: &[u8], iterations: u32) -> String {
    let (stored_key, server_key) = scram_keys(password, salt, iterations);
    format!(
        "SCRAM-SHA-256${iterations}:{}${}:{}",
        STANDARD.encode(salt),
        STANDARD.encode(stored_key),
        STANDARD.encode(server_key)
    )
}

/// Whether `stored` (a `pg_authid.rolpassword` value) is a SCRAM-SHA-256 verifier of
/// `password`. Anything else (NULL, MD5, malformed) is `false`.
/// The most PBKDF2 iterations [`verifies`] computes (PostgreSQL's default is 4096).
pub const MAX_ITERATIONS: u32 = 100_000;

pub fn verifies(stored: &str, password: &Password) -> bool {
    let Some(rest) = stored.strip_prefix("SCRAM-SHA-256$") else {
        return false;
    };
    let Some((params, keys)) = rest.split_once('$') else {
        return false;
    };
    let Some((iterations, salt)) = params.split_once(':') else {
        return false;
    };
    let Some((stored_key, server_key)) = keys.split_once(':') else {
        return false;
    };
    let (Ok(iterations), Ok(salt), Ok(stored_key), Ok(server_key)) = (
        iterations.parse::<u32>(),
        STANDARD.decode(salt),
        STANDARD.decode(stored_key),
        STANDARD.decode(server_key),
    ) else {
        return false;
    };
    // A role can set its own verifier with any iteration count; checking one costs that many
    // PBKDF2 rounds. Above this cap it is treated as not matching (and replaced by one of
    // ours, for the same password).
    if iterations == 0 || iterations > MAX_ITERATIONS {
        return false;
    }
    let (sk, svk) = scram_keys(password.expose().as_bytes(), &salt, iterations);
    constant_time_eq(&sk, &stored_key) && constant_time_eq(&svk, &server_key)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn scram_keys(password: &[u8], salt: &[u8], iterations: u32) -> ([u8; 32], [u8; 32]) {
    let salted = hi(password, salt, iterations);
    let client_key = hmac_sha256(&salted, b"Client Key");
    let stored_key: [u8; 32] = Sha256::digest(client_key).into();
    let server_key = hmac_sha256(&salted, b"Server Key");
    (stored_key, server_key)
}

/// PBKDF2-HMAC-SHA-256 with one output block (SCRAM's `Hi`).
fn hi(password: &[u8], salt: &[u8], iterations: u32) -> [u8; 32] {
    let mut msg = salt.to_vec();
    msg.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac_sha256(password, &msg);
    let mut out = u;
    for _ in 1..iterations {
        u = hmac_sha256(password, &u);
        for (o, x) in out.iter_mut().zip(u.iter()) {
            *o ^= x;
        }
    }
    out
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    let inner = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner);
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_passwords_are_long_url_safe_and_distinct() {
        let a = Password::generate();
        let b = Password::generate();
        assert_eq!(a.expose().len(), LENGTH);
        assert!(a.expose().bytes().all(|c| ALPHABET.contains(&c)));
        assert_ne!(a, b);
        // 64-symbol alphabet → 6 bits per character.
        const { assert!(LENGTH * 6 >= 128) };
        assert_eq!(ALPHABET.len(), 64);
    }

    #[test]
    fn passwords_do_not_print() {
        let p = Password::from_existing("hunter2".into());
        assert_eq!(format!("{p:?} {p}"), "<redacted> <redacted>");
    }

    #[test]
    fn verifier_matches_known_vector() {
        // The same vector as rust-postgres' postgres-protocol tests.
        let salt: [u8; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        assert_eq!(
            scram_verifier_with_salt(b"secret", &salt, 4096),
            "SCRAM-SHA-256$4096:AQIDBAUGBwgJCgsMDQ4PEA==$8rrDg00OqaiWXJ7p+sCgHEIaBSHY89ZJl3mfIsf32oY=:05L1f+yZbiN8O0AnO40Og85NNRhvzTS57naKRWCcsIA="
        );
    }

    #[test]
    fn verifies_own_verifier_only() {
        let p = Password::generate();
        let v = p.scram_verifier();
        assert!(v.starts_with("SCRAM-SHA-256$4096:"));
        assert!(verifies(&v, &p));
        assert!(!verifies(&v, &Password::generate()));
        assert!(!verifies("md5abcdef", &p));
        assert!(!verifies("SCRAM-SHA-256$x", &p));
        assert!(!verifies("", &p));
        // The verifier is safe inside a single-quoted literal.
        assert!(!v.contains('\'') && !v.contains('\\'));
    }
}
