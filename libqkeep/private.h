/*
 * private.h: every private header of the core, for the test suites, fuzz targets and benches that
 * reach into it (they link the core statically, libqkeep_core.la). No file of the core includes
 * it: each includes its own layer's header, which includes the layers below (see README's layout;
 * tests/check_layers.sh fails when a file reaches up). Not installed.
 */
#ifndef QKEEP_PRIVATE_H
#define QKEEP_PRIVATE_H

#include "base/base.h"
#include "base/formats.h"
#include "base/numeric.h"
#include "device/device.h"
#include "device/stream.h"
#include "format/checkpoint.h"
#include "format/conf.h"
#include "format/fusion.h"
#include "format/pattern.h"
#include "format/provider.h"
#include "format/safetensors.h"
#include "load/load.h"
#include "model/model.h"
#include "param/param.h"
#include "plugin/plugin.h"
#include "quantize/quant.h"
#include "reload/reload.h"
#include "reload/test_control.h"
#include "scheme/scheme.h"
#include "scheme/shard_plan.h"

#endif
