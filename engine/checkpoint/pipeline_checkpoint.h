// pipeline_checkpoint.h — a checkpoint of a pipeline: the first stage writes it, and the other stages send it
// their units' parameters and optimizer state, whole or a piece at a time (PieceState::stages_send_pieces).
#pragma once

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/checkpoint/state_pieces.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/pipeline.h"

namespace strata::engine {

// The first stage's read of the next piece another stage sends of state k of `unit` (where
// PieceState::stages_send_pieces), which must start at element `offset` and hold at most `max_len`.
Result<PieceState::StatePiece> pipeline_recv_piece(const PipelinePlan& plan, comm::Communicator& pp, size_t unit,
                                                  int k, size_t offset, size_t max_len,
                                                  const PieceState::PieceBuffer& buffer);
// What the other stages (of data-parallel rank 0) do while the first writes a checkpoint: send it their units'
// parameters, then their moments, in the order it reads them: a piece at a time where the optimizer says
// (PieceState::stages_send_pieces: the fp32 master weights, m and v, each piece taken from the state where it
// lies, or gathered from the stage's ZeRO-3 shards), whole units otherwise. With a ShardedAdamW (moments
// sharded over the stage's data-parallel group, which serves the gathers), the caller then ends the gathers
// (end_checkpoint).
Status take_part_in_pipeline_checkpoint(const Model& model, const PipelinePlan& plan, Optimizer& opt,
                                        comm::Communicator& pp);

}  // namespace strata::engine
