//! The `--api-key` check. The key is compared in constant time: an `==` on strings returns
//! at the first byte that differs, so the time a refusal takes tells a client how many
//! leading bytes of its guess were right, and the key can be found a byte at a time.

use axum::http::{HeaderMap, header};

/// Whether `headers` carry `Authorization: Bearer KEY` with the server's `key`. The scheme's
/// name is case-insensitive and may be followed by more than one space (RFC 9110 §11.1:
/// `bearer KEY` is the same credential).
pub fn key_matches(headers: &HeaderMap, key: &str) -> bool {
    let given = headers.get(header::AUTHORIZATION).and_then(|v| {
        let v = v.as_bytes();
        let (scheme, rest) = v.split_at_checked(6)?;
        let token = rest.trim_ascii_start();
        (scheme.eq_ignore_ascii_case(b"Bearer") && token.len() < rest.len()).then_some(token)
    });
    match given {
        Some(given) => same_bytes(given, key.as_bytes()),
        None => false,
    }
}

/// `given == key` in a time that depends on the length of `given` only: every byte of it is
/// compared (with the key's bytes, cycled) and the differences are OR-ed, with no branch
/// on their values; a length mismatch is folded into the same result instead of returning
/// early. (`subtle` is not in the dependency tree; this is what its `ConstantTimeEq` does.)
fn same_bytes(given: &[u8], key: &[u8]) -> bool {
    if key.is_empty() {
        // No byte to compare with: an empty key matches only an empty value.
        return given.is_empty();
    }
    let mut diff = u8::from(given.len() != key.len());
    for (i, &g) in given.iter().enumerate() {
        diff |= g ^ key[i % key.len()];
    }
    // Keeps the optimizer from turning the fold into a loop that exits at the first
    // difference.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::{key_matches, same_bytes};
    use axum::http::{HeaderMap, HeaderValue, header};

    #[test]
    fn only_the_exact_key_matches() {
        assert!(same_bytes(b"sekrit", b"sekrit"));
        for wrong in [
            &b""[..],
            b"s",
            b"sekri",
            b"sekrix",
            b"xekrit",
            b"sekritsekrit",
            b"sekrit ",
            b"SEKRIT",
        ] {
            assert!(!same_bytes(wrong, b"sekrit"), "{wrong:?}");
        }
        assert!(same_bytes(b"", b""));
        assert!(!same_bytes(b"x", b""));
    }

    #[test]
    fn the_key_comes_as_a_bearer_token() {
        let with = |value: &[u8]| {
            let mut h = HeaderMap::new();
            h.insert(
                header::AUTHORIZATION,
                HeaderValue::from_bytes(value).unwrap(),
            );
            h
        };
        assert!(key_matches(&with(b"Bearer sekrit"), "sekrit"));
        // The scheme in any case, and more than one space after it.
        assert!(key_matches(&with(b"bearer sekrit"), "sekrit"));
        assert!(key_matches(&with(b"BEARER  sekrit"), "sekrit"));
        assert!(!key_matches(&with(b"Bearersekrit"), "sekrit"));
        assert!(!key_matches(&with(b"Bearer"), "sekrit"));
        assert!(!key_matches(&with(b"Bearer sekrit "), "sekrit"));
        assert!(!key_matches(&with(b"Bearer sekrix"), "sekrit"));
        assert!(!key_matches(&with(b"Basic sekrit"), "sekrit"));
        assert!(!key_matches(&with(b"sekrit"), "sekrit"));
        // A header that is not valid UTF-8 is compared as bytes, and refused.
        assert!(!key_matches(&with(b"Bearer sekr\xe9t"), "sekrit"));
        assert!(!key_matches(&HeaderMap::new(), "sekrit"));
    }
}
