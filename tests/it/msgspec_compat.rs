//! The payload is byte for byte what Python's `msgspec.msgpack.encode` gives
//! for vLLM's `(1, num_tokens, [(group_id, fingerprint, start, values), ...])`
//! (SPEC section 9), vLLM's typed decode reads our bytes, and we decode
//! msgspec's bytes of payloads Python drew itself.
//!
//! Needs `python3` with `msgspec` (`python3 -m pip install msgspec`; `.ci/run`
//! installs it). Without them this test FAILS, unless `KVCS_SKIP_PYTHON=1`
//! says to skip it. `KVCS_PYTHON` names another interpreter.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it msgspec_compat::`.

use crate::support;

use std::io::Write;
use std::process::{Command, Stdio};

use kvcsum::payload::{Payload, PayloadGroup};
use support::Rng;

/// Reads payload lines on stdin (`num_tokens;gid,fp,start,hex;...`), and
/// prints per line: msgspec's encoding, then whether vLLM's typed decode of
/// our bytes (the next input line, `ours:hex`) gives the same payload; then
/// Python's own random payloads as `line=hex`.
const SCRIPT: &str = r#"
import random, sys
import msgspec

def parse(line):
    fields = line.split(";")
    groups = []
    for group in fields[1:]:
        gid, fp, start, values = group.split(",")
        groups.append((int(gid), int(fp), int(start), bytes.fromhex(values)))
    return (1, int(fields[0]), groups)

VLLM_TYPE = tuple[int, int, list[tuple[int, int, int, bytes]]]
lines = sys.stdin.read().split("\n")
seed = int(lines[0])
for description, ours in zip(lines[1::2], lines[2::2]):
    payload = parse(description)
    print("msgspec:" + msgspec.msgpack.encode(payload).hex())
    decoded = msgspec.msgpack.decode(bytes.fromhex(ours[len("ours:"):]), type=VLLM_TYPE)
    print("typed:" + ("same" if decoded == payload else "differs: " + repr(decoded)[:200]))

rng = random.Random(seed)
def number():
    return rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
                       rng.randrange(2**64), rng.randrange(2**16)])
for _ in range(100):
    groups = []
    for _ in range(rng.choice([0, 1, 2, 3, 15, 16, 17])):
        count = rng.choice([8191, 8192]) if rng.random() < 0.03 else rng.choice([0, 1, 31, 32, 100])
        values = b"".join(rng.randrange(2**64).to_bytes(8, "little") for _ in range(count))
        groups.append((rng.randrange(2**32), number(), number() >> 1, values))
    payload = (1, number(), groups)
    line = ";".join([str(payload[1])] + [f"{g},{f},{s},{v.hex()}" for g, f, s, v in groups])
    print(line + "=" + msgspec.msgpack.encode(payload).hex())
"#;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

fn describe(payload: &Payload) -> String {
    let mut line = payload.num_tokens.to_string();
    for group in &payload.groups {
        let values: Vec<u8> = group.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        line += &format!(
            ";{},{},{},{}",
            group.group_id,
            group.fingerprint,
            group.first_position,
            hex(&values)
        );
    }
    line
}

fn parse(line: &str) -> Payload {
    let mut fields = line.split(';');
    let num_tokens = fields.next().unwrap().parse().unwrap();
    let groups = fields
        .map(|group| {
            let parts: Vec<&str> = group.split(',').collect();
            let bytes = unhex(parts[3]);
            PayloadGroup {
                group_id: parts[0].parse().unwrap(),
                fingerprint: parts[1].parse().unwrap(),
                first_position: parts[2].parse().unwrap(),
                values: bytes
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            }
        })
        .collect();
    Payload {
        num_tokens,
        groups,
        extension: None,
    }
}

/// A number from every msgpack integer width, or a random one.
fn number(rng: &mut Rng) -> u64 {
    let (any, small) = (rng.next_u64(), rng.below(1 << 20));
    *rng.pick(&[
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        u32::MAX as u64,
        1 << 32,
        u64::MAX,
        any,
        small,
    ])
}

fn random_payload(rng: &mut Rng) -> Payload {
    let num_groups = *rng.pick(&[0usize, 1, 2, 4, 15, 16, 17]);
    let groups = (0..num_groups)
        .map(|index| {
            // 31 values fill a bin 8, 32 need a bin 16, 8192 a bin 32.
            let count = if rng.chance(1, 30) {
                *rng.pick(&[8191usize, 8192])
            } else {
                *rng.pick(&[0usize, 1, 31, 32, 100])
            };
            PayloadGroup {
                // Distinct ids, from every width.
                group_id: (number(rng) as u32).wrapping_add(index as u32 * 0x1_0001),
                fingerprint: number(rng),
                first_position: number(rng) >> 1,
                values: (0..count).map(|_| rng.next_u64()).collect(),
            }
        })
        .collect();
    Payload {
        num_tokens: number(rng),
        groups,
        extension: None,
    }
}

#[test]
fn payloads_are_byte_identical_to_msgspec_both_ways() {
    if std::env::var("KVCS_SKIP_PYTHON").as_deref() == Ok("1") {
        eprintln!("KVCS_SKIP_PYTHON=1: skipping the msgspec comparison");
        return;
    }
    let mut rng = Rng::for_test("payloads_are_byte_identical_to_msgspec_both_ways");
    let seed = rng.seed();
    let mut payloads: Vec<Payload> = (0..100).map(|_| random_payload(&mut rng)).collect();
    payloads.retain(|p| p.validate().is_ok());
    let mut input = format!("{seed}\n");
    for payload in &payloads {
        input += &format!("{}\nours:{}\n", describe(payload), hex(&payload.encode()));
    }
    let python = std::env::var("KVCS_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {python:?} ({e}): install python3 with msgspec, or set KVCS_SKIP_PYTHON=1 to skip")
        });
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.trim_end().as_bytes()));
    let output = child.wait_with_output().expect("python output");
    writer.join().unwrap().expect("write to python");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{python} failed (is msgspec installed? `{python} -m pip install msgspec`, or KVCS_SKIP_PYTHON=1 to skip): {stderr}"
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let mut lines = stdout.lines();
    for (index, payload) in payloads.iter().enumerate() {
        let theirs = lines
            .next()
            .and_then(|l| l.strip_prefix("msgspec:"))
            .expect("msgspec line");
        assert_eq!(
            hex(&payload.encode()),
            theirs,
            "payload {index}, seed {seed}: our bytes differ from msgspec's"
        );
        assert_eq!(
            &Payload::decode(&unhex(theirs)).unwrap(),
            payload,
            "payload {index}, seed {seed}"
        );
        let typed = lines.next().expect("typed line");
        assert_eq!(
            typed, "typed:same",
            "payload {index}, seed {seed}: vLLM's typed decode of our bytes"
        );
    }
    let mut own = 0;
    for line in lines {
        let (description, bytes) = line.split_once('=').expect("python payload line");
        let expected = parse(description);
        let bytes = unhex(bytes);
        match expected.validate() {
            // Random group ids may repeat; we reject duplicates (vLLM keeps the last).
            Err(_) => assert!(Payload::decode(&bytes).is_err()),
            Ok(()) => {
                assert_eq!(
                    Payload::decode(&bytes).unwrap(),
                    expected,
                    "seed {seed}: {description:.80}"
                );
                assert_eq!(expected.encode(), bytes, "seed {seed}");
                own += 1;
            }
        }
    }
    assert!(own >= 75, "python drew {own} valid payloads of 100");
}
