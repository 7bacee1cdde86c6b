//! The host engine's rules as a worker's engine: host memory is checked
//! page by page, the layout changes in place (it checks before it
//! changes), values are computed now, and stored checksums are written and
//! read by the host after (store) or before (load check) the checksums.

use super::engine::{Call, ChecksumWith, Detail, Engine, LayoutChange};
use crate::base::checksum::Algorithm;
use crate::base::error::Result;
use crate::engines::cuda::{DeviceEngine, StoredMode};
use crate::engines::detail::Shadow;
use crate::engines::host::{self, HostEngine};
use crate::engines::stored;
use crate::inputs::blocks::BlockSet;
use crate::inputs::layout::{Layout, Region, StoredBuffer};
use crate::inputs::role::Role;
use crate::inputs::stream::StreamHandle;
use crate::plan::{full_block_rows, FullBlock, FullBlockRows, Plan};
use crate::results::checksums::{Checksums, StoredExpectation, StoredValues, Values};

impl Engine for HostEngine {
    fn description(&self) -> String {
        format!(
            "host engine, {} threads ({} helper threads started), {} mixing",
            self.threads(),
            self.helpers(),
            self.simd().name()
        )
    }

    fn check_region(&self, region: Region) -> Result<()> {
        host::check_mapped(region)
    }

    fn change_layout(&mut self, layout: &mut Layout, change: LayoutChange<'_>) -> Result<()> {
        change(layout)
    }

    fn add_stored(&self, layout: &mut Layout, group_id: u32, buffer: StoredBuffer) -> Result<()> {
        layout.set_stored(group_id, buffer, true)
    }

    fn checksum(
        &self,
        call: &Call<'_>,
        blocks: &BlockSet,
        role: Role,
        _stream: StreamHandle,
        _stored: Option<StoredMode>,
        _expectations: &mut Vec<StoredExpectation>,
    ) -> Result<(Plan, Values)> {
        let (plan, rows) = Plan::new(call.layout, blocks, role)?;
        let values = Values::Ready(self.compute(call.layout, &plan, &rows, role, call.algorithm));
        Ok((plan, values))
    }

    fn full_block_values(
        &self,
        call: &Call<'_>,
        blocks: &[FullBlock],
        role: Role,
        _stream: StreamHandle,
        rows: &mut FullBlockRows,
        values: &mut Vec<u64>,
    ) -> Result<Option<Values>> {
        full_block_rows(call.layout, blocks, rows)?;
        values.clear();
        values.resize(blocks.len(), 0);
        self.compute_into(call.layout, &rows.rows, role, call.algorithm, values);
        Ok(None)
    }

    fn store(&self, call: &Call<'_>, blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums> {
        // Checked before the (host) checksums are computed.
        stored::check_blocks(call.layout, &call.infos, blocks, call.algorithm)?;
        let result = checksum_with(None)?.0;
        stored::store(call.layout, &call.infos, blocks, call.algorithm, &result)?;
        Ok(result)
    }

    fn check_stored(&self, call: &Call<'_>, blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums> {
        let (expectations, read) = stored::expectations(call.layout, &call.infos, blocks, call.algorithm)?;
        Ok(checksum_with(None)?
            .0
            .with_stored(expectations, StoredValues::Read(read)))
    }

    fn detail_engine(&self, _shadow: &Shadow) -> Result<Option<DeviceEngine>> {
        Ok(None)
    }

    fn detail_values(
        &self,
        detail: &Detail,
        shadow_blocks: &BlockSet,
        role: Role,
        algorithm: Algorithm,
        _stream: StreamHandle,
    ) -> Result<(Plan, Values)> {
        let shadow = &detail.shadow;
        let (plan, rows) = Plan::new(&shadow.layout, shadow_blocks, role)?;
        let values = Values::Ready(self.compute(&shadow.layout, &plan, &rows, role, algorithm));
        Ok((plan, values))
    }
}
