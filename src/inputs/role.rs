//! A worker's role: which columns it computes (SPEC section 4).

/// Which columns a worker computes (SPEC section 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Only columns with `replica_index == 0`: any copy describes the KV.
    Producer,
    /// Every column, so that every copy is checked.
    Consumer,
}

impl Role {
    /// The role's number in records and the C API (`KVCS_ROLE_*`): 0 producer, 1 consumer.
    pub fn code(self) -> u32 {
        match self {
            Role::Producer => 0,
            Role::Consumer => 1,
        }
    }

    /// The role numbered `code` (see [`Role::code`]), or `None`.
    pub fn from_code(code: u64) -> Option<Role> {
        match code {
            0 => Some(Role::Producer),
            1 => Some(Role::Consumer),
            _ => None,
        }
    }
}
