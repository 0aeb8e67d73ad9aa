//! Kubernetes resource quantities (`500m`, `2`, `10Gi`, `1e3`) as exact integers.
//!
//! The tenant-wide quota is split across namespaces by arithmetic on quantities, and usage
//! is summed over namespaces, so both need exact values: a [`Milli`] is a quantity in
//! thousandths (`"1.5"` is 1500, `"1Ki"` is 1 024 000). Values finer than a thousandth are
//! rounded up, as the API server does.

use std::fmt;

/// A quantity in thousandths of its unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Milli(pub i128);

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {value:?}: {why}")]
pub struct ParseError {
    pub value: String,
    pub why: &'static str,
}

/// Largest magnitude accepted, in thousandths (the API server caps at 2^63-1 units).
const LIMIT: i128 = (i64::MAX as i128) * 1000;

impl Milli {
    pub const ZERO: Milli = Milli(0);

    /// Whole units (`Milli(2000)` for `"2"`).
    pub fn units(n: i64) -> Milli {
        Milli(i128::from(n) * 1000)
    }

    /// Parses a quantity string (Kubernetes' grammar: sign, decimal number, then a binary SI
    /// suffix, a decimal SI suffix or an `e`/`E` exponent).
    ///
    /// # Errors
    /// [`ParseError`] for anything the API server would not accept.
    pub fn parse(input: &str) -> Result<Milli, ParseError> {
        let err = |why| ParseError {
            value: input.to_string(),
            why,
        };
        let s = input.trim();
        let (negative, s) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        let number_end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, suffix) = s.split_at(number_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(err("expected a number"));
        }
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        let digits = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 30 {
            return Err(err("too many digits"));
        }
        let mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| err("expected a number"))?
        };
        let frac_len = u32::try_from(frac_part.len()).map_err(|_| err("too many digits"))?;

        // value = mantissa × 10^-frac_len × multiplier; result in thousandths.
        let (binary, exp10): (u32, i32) = match suffix {
            "Ki" => (1, 0),
            "Mi" => (2, 0),
            "Gi" => (3, 0),
            "Ti" => (4, 0),
            "Pi" => (5, 0),
            "Ei" => (6, 0),
            "n" => (0, -9),
            "u" => (0, -6),
            "m" => (0, -3),
            "" => (0, 0),
            "k" => (0, 3),
            "M" => (0, 6),
            "G" => (0, 9),
            "T" => (0, 12),
            "P" => (0, 15),
            "E" => (0, 18),
            other => {
                let exp = other
                    .strip_prefix(['e', 'E'])
                    .ok_or_else(|| err("unknown suffix"))?;
                let exp: i32 = exp.parse().map_err(|_| err("malformed exponent"))?;
                if !(-30..=30).contains(&exp) {
                    return Err(err("exponent out of range"));
                }
                (0, exp)
            }
        };
        let too_large = || err("too large");
        let mut numerator = mantissa.checked_mul(1000).ok_or_else(too_large)?;
        numerator = numerator
            .checked_mul(1024i128.pow(binary))
            .ok_or_else(too_large)?;
        let mut denominator: i128 = 10i128.checked_pow(frac_len).ok_or_else(too_large)?;
        if exp10 >= 0 {
            numerator = numerator
                .checked_mul(10i128.pow(exp10.unsigned_abs()))
                .ok_or_else(too_large)?;
        } else {
            denominator = denominator
                .checked_mul(10i128.pow(exp10.unsigned_abs()))
                .ok_or_else(too_large)?;
        }
        // Round up away from zero, as the API server does for sub-milli precision.
        let mut value = numerator / denominator + i128::from(numerator % denominator != 0);
        if value > LIMIT {
            return Err(too_large());
        }
        if negative {
            value = -value;
        }
        Ok(Milli(value))
    }

    /// Whether this is a whole number of units.
    pub fn is_whole(self) -> bool {
        self.0 % 1000 == 0
    }

    pub fn saturating_sub(self, other: Milli) -> Milli {
        Milli(self.0.saturating_sub(other.0))
    }

    pub fn saturating_add(self, other: Milli) -> Milli {
        Milli(self.0.saturating_add(other.0))
    }

    /// Formats for resource `name`: whole numbers plainly (`"4"`), fractions in thousandths
    /// (`"1500m"`), and memory or storage with the largest exact binary suffix (`"10Gi"`).
    pub fn format_for(self, name: &str) -> String {
        let bytes_like = ["memory", "storage"].iter().any(|k| name.contains(k));
        if bytes_like && self.is_whole() && self.0 != 0 {
            let units = self.0 / 1000;
            for (suffix, power) in [
                ("Ei", 6u32),
                ("Pi", 5),
                ("Ti", 4),
                ("Gi", 3),
                ("Mi", 2),
                ("Ki", 1),
            ] {
                let factor = 1024i128.pow(power);
                if units % factor == 0 {
                    return format!("{}{suffix}", units / factor);
                }
            }
        }
        self.to_string()
    }
}

impl fmt::Display for Milli {
    /// `"2"` for whole numbers, `"1500m"` otherwise.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_whole() {
            write!(f, "{}", self.0 / 1000)
        } else {
            write!(f, "{}m", self.0)
        }
    }
}

impl std::str::FromStr for Milli {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Milli::parse(s)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn q(s: &str) -> i128 {
        Milli::parse(s).unwrap().0
    }

    #[test]
    fn parses_every_suffix_form() {
        assert_eq!(q("2"), 2000);
        assert_eq!(q("500m"), 500);
        assert_eq!(q("1.5"), 1500);
        assert_eq!(q(".5"), 500);
        assert_eq!(q("1Ki"), 1_024_000);
        assert_eq!(q("10Gi"), 10 * 1024 * 1024 * 1024 * 1000);
        assert_eq!(q("1k"), 1_000_000);
        assert_eq!(q("1e3"), 1_000_000);
        assert_eq!(q("1E-3"), 1);
        assert_eq!(q("+3"), 3000);
        assert_eq!(q("-3"), -3000);
        assert_eq!(q("0"), 0);
        assert_eq!(q("1n"), 1, "sub-milli rounds up");
        assert_eq!(q("1500u"), 2, "1.5m rounds up to 2m");
    }

    #[test]
    fn rejects_malformed_input() {
        for bad in [
            "", "ten", "1.2.3", "5x", "Gi", "1e", "1eX", ".", "1 Gi", "--1", "1e99",
        ] {
            assert!(Milli::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn formats_round_trip() {
        assert_eq!(Milli(1500).to_string(), "1500m");
        assert_eq!(Milli(4000).to_string(), "4");
        assert_eq!(
            Milli::parse("10Gi").unwrap().format_for("requests.memory"),
            "10Gi"
        );
        assert_eq!(
            Milli::parse("1536Mi").unwrap().format_for("limits.memory"),
            "1536Mi"
        );
        assert_eq!(
            Milli::units(2048).format_for("pods"),
            "2048",
            "counts never get binary suffixes"
        );
        for s in ["1500m", "3", "7Gi", "100Mi"] {
            let m = Milli::parse(s).unwrap();
            assert_eq!(Milli::parse(&m.format_for("memory")).unwrap(), m);
        }
    }
}
