// epmoe: one include for the whole public API.
#pragma once

#include "epmoe/config.h"
#include "epmoe/status.h"
#include "epmoe/version.h"
