use super::*;

/// xorshift64: seeded random words, never zeros.
fn random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn config(state: &mut u64) -> EntryConfig {
    EntryConfig {
        fingerprint: random(state),
        geometry: 0,
        coverage: random(state),
        block_size: 1 + (random(state) % 256) as u32,
        algorithm: Algorithm::Mixed,
        state: false,
    }
}

/// SPEC section 8's test vectors.
#[test]
fn entries_are_the_spec_test_vectors() {
    let (hash, sum) = (0x1122_3344_5566_7788u64, 0x8000_0000_0000_0001u64);
    for (block_size, algorithm, tokens, stamp) in [
        (16, Algorithm::Mixed, 16, 0x8814_0434_c411_3953u64),
        (16, Algorithm::Mixed, 11, 0xdb95_7e1e_c411_3948),
        (16, Algorithm::Weighted, 16, 0xd267_ae02_25d9_bf9a),
        (32, Algorithm::Mixed, 16, 0xe35e_9eb0_2502_a53c),
    ] {
        let config = EntryConfig {
            fingerprint: 0x0123_4567_89ab_cdef,
            geometry: 0,
            coverage: 0xfedc_ba98_7654_3210,
            block_size,
            algorithm,
            state: false,
        };
        let tag = block_tag(hash, config.fingerprint);
        let got = entry(sum, tag, hash, config.digests().digest(tokens));
        assert_eq!(
            got,
            (0x9001_7623_dccd_ba66, stamp),
            "{block_size} {algorithm:?} {tokens}"
        );
        assert_eq!(
            config.reader().judge(hash, tag, tokens, sum, got),
            StoredOutcome::Matched
        );
    }
}

#[test]
fn outcome_codes_round_trip() {
    for code in 0..=255u8 {
        if let Some(outcome) = StoredOutcome::from_code(code) {
            assert_eq!(outcome.code(), code);
        } else {
            assert!(code > 6, "{code}");
        }
    }
}

/// A clean entry matches; its sum changed fails; read with more tokens
/// it is another token count; under another algorithm or another
/// configuration it is that, never a failure.
#[test]
fn a_clean_entry_reads_as_what_stored_it() {
    let mut state = 0x0123_4567_89ab_cdefu64;
    for _ in 0..1000 {
        let config = config(&mut state);
        let (hash, sum) = (random(&mut state), random(&mut state));
        let tag = hash ^ config.fingerprint;
        let stored = 1 + (random(&mut state) % config.block_size as u64) as u32;
        let entry = entry(sum, tag, hash, config.digests().digest(stored));
        let reader = config.reader();
        assert_eq!(reader.judge(hash, tag, stored, sum, entry), StoredOutcome::Matched);
        assert_eq!(reader.judge(hash, tag, stored, sum ^ 1, entry), StoredOutcome::Failed);
        if stored < config.block_size {
            assert_eq!(
                reader.judge(hash, tag, stored + 1, sum, entry),
                StoredOutcome::OtherTokens
            );
        }
        let weighted = EntryConfig {
            algorithm: Algorithm::Weighted,
            ..config
        };
        assert_eq!(
            weighted.reader().judge(hash, tag, stored, sum, entry),
            StoredOutcome::OtherAlgorithm
        );
        let other = EntryConfig {
            fingerprint: random(&mut state),
            ..config
        };
        assert_eq!(
            other.reader().judge(hash, hash ^ other.fingerprint, stored, sum, entry),
            StoredOutcome::OtherFingerprint
        );
        // Another cell size (geometry) reads as another configuration.
        let reshaped = EntryConfig {
            geometry: random(&mut state),
            ..config
        };
        assert_eq!(
            reshaped.reader().judge(hash, tag, stored, sum, entry),
            StoredOutcome::OtherFingerprint
        );
        let resized = EntryConfig {
            block_size: config.block_size + 1,
            ..config
        };
        assert_eq!(
            resized.reader().judge(hash, tag, stored, sum, entry),
            StoredOutcome::OtherFingerprint
        );
    }
}
