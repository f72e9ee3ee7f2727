#pragma once
// Knowledge distillation in `kiln train` ([distill] in the config,
// docs/distillation.md): the teacher a student run learns from, loaded from
// another run's directory, and the loss that mixes its logits with the labels.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/config.h"
#include "kiln/core/tensor.h"
#include "kiln/data/dataset.h"
#include "kiln/nn/module.h"

namespace kiln::cli {

struct Task;

struct Distiller {
  std::shared_ptr<nn::Module> teacher;  // in eval mode for good: its batch norms use their running statistics
  std::filesystem::path checkpoint;     // the teacher's weights
  std::string teacher_model;            // its model.type
  std::string kind;                     // "soft" or "hard"
  double temperature = 2.0, alpha = 0.5;
};

/// The teacher of distill.teacher for a student task (Purpose::Train, after its
/// model and data are built), or null when distill.teacher is "". The teacher's
/// own config (from its checkpoint) rebuilds its model; its best checkpoint is
/// used when the run kept one, else its newest usable one. The default
/// generator and the thread count are the student's afterwards. ConfigError
/// (naming the key, both values where two disagree) for a missing directory or
/// checkpoint, a language model on either side, a class count or input shape
/// that differs from the student's, and dist.strategy zero3 (whose forward the loss cannot reach).
std::shared_ptr<Distiller> make_distiller(const Config& student, const Task& t);

/// The student's training loss for one batch given its logits: the teacher runs
/// on the same (augmented) inputs under no_grad, then distillation_loss
/// (kind soft) or hard_distillation_loss (kind hard).
Tensor distillation_batch_loss(Distiller& d, const Tensor& student_logits, const data::Example& batch);

/// One line for the run's start: the teacher, its checkpoint, the loss settings
/// and the teacher's accuracy on the student's evaluation set, through the
/// student's own data pipeline (a wrong normalisation or label order shows
/// up here as a teacher far below its own run's figure).
std::string distill_note(Distiller& d, const Task& t, const Config& student);

}  // namespace kiln::cli
