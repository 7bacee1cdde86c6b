//! The device engine's rules as a worker's engine: regions and stored
//! buffers are checked with CUDA, the layout changes on a copy that the
//! device takes first, values are queued on the caller's stream, and
//! stored checksums are stored or gathered by the same call, their items
//! checked before anything is queued.

use super::engine::{Call, ChecksumWith, Detail, Engine, LayoutChange};
use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::engines::cuda::{DeviceEngine, StoredMode};
use crate::engines::detail::Shadow;
use crate::engines::stored;
use crate::inputs::blocks::BlockSet;
use crate::inputs::layout::{Layout, Region, StoredBuffer};
use crate::inputs::role::Role;
use crate::inputs::stream::StreamHandle;
use crate::plan::{full_block_plan, FullBlock, FullBlockRows, Plan, RowRoom};
use crate::results::checksums::{Checksums, StoredExpectation, StoredValues, Values};

impl Engine for DeviceEngine {
    fn description(&self) -> String {
        DeviceEngine::description(self).to_owned()
    }

    fn check_region(&self, region: Region) -> Result<()> {
        DeviceEngine::check_region(self, region.address, region.length)
    }

    fn change_layout(&mut self, layout: &mut Layout, change: LayoutChange<'_>) -> Result<()> {
        // The worker keeps its layout until the device has the new one.
        let mut changed = layout.clone();
        change(&mut changed)?;
        self.upload_layout(&changed)?;
        *layout = changed;
        Ok(())
    }

    fn add_stored(&self, layout: &mut Layout, group_id: u32, buffer: StoredBuffer) -> Result<()> {
        let StoredBuffer { address, num_blocks } = buffer;
        // The layout's checks first (group, alignment, length), then CUDA's.
        layout.check_stored(group_id, buffer, false)?;
        self.check_writable(address, num_blocks * StoredBuffer::BYTES_PER_BLOCK)
            .map_err(|e| {
                e.with_context(&format!(
                    "stored checksums of group_id {group_id} (address {address:#x}, num_blocks {num_blocks})"
                ))
            })?;
        layout.set_stored(group_id, buffer, false)
    }

    fn checksum(
        &self,
        call: &Call<'_>,
        blocks: &BlockSet,
        role: Role,
        stream: StreamHandle,
        stored: Option<StoredMode>,
        expectations: &mut Vec<StoredExpectation>,
    ) -> Result<(Plan, Values)> {
        let algorithm = call.algorithm;
        // The engine lays out the blocks into the call's pinned memory,
        // then asks for the stored items of that plan.
        let stored_work = |plan: &Plan| match stored {
            None => Ok(None),
            Some(mode) => {
                let (work, expected) =
                    stored::device_work(call.layout, &call.infos, blocks, algorithm, &plan.shape, mode)?;
                *expectations = expected;
                Ok(Some(work))
            }
        };
        DeviceEngine::checksum(self, call.layout, blocks, role, algorithm, stream, stored_work)
    }

    fn full_block_values(
        &self,
        call: &Call<'_>,
        blocks: &[FullBlock],
        role: Role,
        stream: StreamHandle,
        rows: &mut FullBlockRows,
        _values: &mut Vec<u64>,
    ) -> Result<Option<Values>> {
        // The rows go straight into the call's pinned memory.
        let computed = &mut rows.computed;
        let write = |room: RowRoom<'_>| full_block_plan(call.layout, blocks, room, computed);
        let (_, values) = DeviceEngine::checksum_planned(
            self,
            call.layout,
            blocks.len(),
            blocks.len(),
            role,
            call.algorithm,
            stream,
            write,
            |_| Ok(None),
        )?;
        Ok(Some(values))
    }

    fn store(&self, _call: &Call<'_>, _blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums> {
        // The items are checked before anything is queued.
        Ok(checksum_with(Some(StoredMode::Store))?.0)
    }

    fn check_stored(&self, _call: &Call<'_>, _blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums> {
        let (result, expectations) = checksum_with(Some(StoredMode::Gather))?;
        Ok(result.with_stored(expectations, StoredValues::Gathered))
    }

    fn detail_engine(&self, shadow: &Shadow) -> Result<Option<DeviceEngine>> {
        let mut engine = DeviceEngine::new(self.ordinal())?;
        if shadow.layout.groups().next().is_some() {
            engine.upload_layout(&shadow.layout)?;
        }
        Ok(Some(engine))
    }

    fn detail_values(
        &self,
        detail: &Detail,
        shadow_blocks: &BlockSet,
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
    ) -> Result<(Plan, Values)> {
        let Some(engine) = &detail.engine else {
            return Err(err!(Internal, "detail mode on a device worker has no shadow engine"));
        };
        engine.checksum(&detail.shadow.layout, shadow_blocks, role, algorithm, stream, |_| {
            Ok(None)
        })
    }
}
