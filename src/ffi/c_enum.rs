//! [`c_enum!`]: the conversions of a C enum, from one list of its variants.
//!
//! A C enum stays a plain `#[repr(u32)]` Rust enum with its doc comments,
//! since cbindgen writes the header from that declaration and does not look
//! inside macro invocations. `c_enum!` then names its variants once more,
//! and that list is checked by the compiler: `name()` is a `match` over
//! it, so a variant left out (or one that does not exist) does not build.
//! From the list come `TryFrom<u32>`, `name()`, `name_of()` (what the
//! `kvcs_*_name` calls give) and `from_arg()`, whose error names the
//! argument, its value and every valid value: "policy 7 is not
//! KVCS_POLICY_FAIL_OPEN (0) or KVCS_POLICY_FAIL_CLOSED (1)".

use std::ffi::CStr;

use crate::base::error::{err, Error};

/// The C string `text`, which ends in its one NUL (made by [`c_enum!`]
/// from a variant's name).
pub(crate) const fn c_name(text: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(text.as_bytes()) {
        Ok(name) => name,
        Err(_) => panic!("a C name is its text and one NUL"),
    }
}

/// The error of argument `arg` whose value `value` is none of `choices`
/// (name, value): "arg 7 is not A (0), B (1) or C (2)".
pub(crate) fn not_one_of(arg: &str, value: u32, choices: impl Iterator<Item = (&'static CStr, u32)>) -> Error {
    let listed: Vec<String> = choices
        .map(|(name, code)| format!("{} ({code})", name.to_str().expect("C names are ASCII")))
        .collect();
    let list = match listed.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::from("any value"),
    };
    err!(InvalidArgument, "{arg} {value} is not {list}")
}

/// For a C enum `$enum` declared (`#[repr(u32)]` or `#[repr(u8)]`, every
/// variant numbered) in the same file, the list of its variants:
///
/// - `$enum::ALL`: every variant, in the order listed;
/// - `name(self)`: its C name, `c"KVCS_..."`;
/// - `name_of(u32)`: the C name of a value, "unknown $enum" for none;
/// - `TryFrom<u32>`: the variant of a value, or the value back as the error;
/// - `from_arg(u32, arg)`: the variant, or `InvalidArgument` naming `arg`,
///   its value and every valid value.
macro_rules! c_enum {
    ($enum:ident { $($variant:ident),+ $(,)? }) => {
        impl $enum {
            /// Every value, in declaration order.
            #[allow(dead_code)]
            pub const ALL: &'static [$enum] = &[$($enum::$variant),+];

            /// Its C name (`"KVCS_..."`), a static string.
            pub fn name(self) -> &'static ::std::ffi::CStr {
                match self {
                    $($enum::$variant => {
                        const NAME: &::std::ffi::CStr =
                            $crate::ffi::c_enum::c_name(concat!(stringify!($variant), "\0"));
                        NAME
                    })+
                }
            }

            /// The C name of the value `code`, or "unknown <enum>" for a
            /// value that is none: what the `kvcs_*_name` calls give.
            #[allow(dead_code)]
            pub fn name_of(code: u32) -> &'static ::std::ffi::CStr {
                const UNKNOWN: &::std::ffi::CStr =
                    $crate::ffi::c_enum::c_name(concat!("unknown ", stringify!($enum), "\0"));
                $enum::try_from(code).map_or(UNKNOWN, $enum::name)
            }

            /// The value `code` of the argument `arg`, or `InvalidArgument`
            /// naming the argument, its value and every valid value.
            #[allow(dead_code)]
            pub(crate) fn from_arg(code: u32, arg: &str) -> $crate::base::error::Result<$enum> {
                $enum::try_from(code).map_err(|code| {
                    $crate::ffi::c_enum::not_one_of(arg, code, $enum::ALL.iter().map(|v| (v.name(), *v as u32)))
                })
            }
        }

        impl ::std::convert::TryFrom<u32> for $enum {
            /// The value, which is no variant.
            type Error = u32;

            fn try_from(code: u32) -> ::std::result::Result<$enum, u32> {
                $(
                    if code == $enum::$variant as u32 {
                        return Ok($enum::$variant);
                    }
                )+
                Err(code)
            }
        }
    };
}

pub(crate) use c_enum;

#[cfg(test)]
mod tests {
    use super::super::completion::kvcs_direction;
    use super::super::report::{kvcs_unverified_reason, kvcs_verdict};
    use super::super::result::kvcs_stored_outcome;
    use super::super::status::kvcs_status;
    use super::super::verifier::kvcs_policy;
    use super::super::worker::{kvcs_algorithm, kvcs_role};

    /// Every listed value converts back from its number and is named by its
    /// variant's own name (the Debug form, derived independently of the
    /// macro); a number past them is refused with every valid value named.
    macro_rules! check_enum {
        ($enum:ident) => {{
            let mut names = Vec::new();
            for &value in $enum::ALL {
                let code = value as u32;
                assert_eq!($enum::try_from(code), Ok(value));
                assert_eq!($enum::name(value).to_str().unwrap(), format!("{value:?}"));
                assert_eq!($enum::name_of(code), value.name());
                names.push(format!("{value:?} ({code})"));
            }
            let past = $enum::ALL.iter().map(|&v| v as u32).max().unwrap() + 1;
            for bad in [past, past + 1000, u32::MAX] {
                assert_eq!($enum::try_from(bad), Err(bad));
                assert_eq!(
                    $enum::name_of(bad).to_str().unwrap(),
                    concat!("unknown ", stringify!($enum))
                );
                let message = $enum::from_arg(bad, "arg").unwrap_err().to_string();
                assert!(message.contains(&format!("arg {bad} is not ")), "{message}");
                for name in &names {
                    assert!(message.contains(name.as_str()), "{message} names {name}");
                }
            }
            names.len()
        }};
    }

    #[test]
    fn every_c_enum_converts_both_ways_and_names_its_values() {
        assert_eq!(check_enum!(kvcs_status), 10);
        assert_eq!(check_enum!(kvcs_verdict), 3);
        assert_eq!(check_enum!(kvcs_unverified_reason), 19);
        assert_eq!(check_enum!(kvcs_policy), 2);
        assert_eq!(check_enum!(kvcs_role), 2);
        assert_eq!(check_enum!(kvcs_algorithm), 3);
        assert_eq!(check_enum!(kvcs_direction), 2);
        assert_eq!(check_enum!(kvcs_stored_outcome), 7);
    }

    #[test]
    fn a_refused_value_lists_the_valid_ones_in_order() {
        assert_eq!(
            kvcs_policy::from_arg(7, "policy").unwrap_err().to_string(),
            crate::base::error::err!(
                InvalidArgument,
                "policy 7 is not KVCS_POLICY_FAIL_OPEN (0) or KVCS_POLICY_FAIL_CLOSED (1)"
            )
            .to_string()
        );
        assert_eq!(
            kvcs_algorithm::from_arg(0, "algorithm").unwrap_err().to_string(),
            crate::base::error::err!(
                InvalidArgument,
                "algorithm 0 is not KVCS_ALGORITHM_WEIGHTED (1), KVCS_ALGORITHM_MIXED (2) or KVCS_ALGORITHM_MIXED2 (3)"
            )
            .to_string()
        );
    }
}
