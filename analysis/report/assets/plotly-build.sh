#!/bin/sh
# Rebuilds plotly-report.min.js: plotly.js core (scatter) + heatmap, the traces the report draws.
# Needs node and npm (registry access); writes into this folder.  See PLOTLY.md.
set -eu
VERSION=4.1.1
ESBUILD=0.25.12
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo '{"name":"plotly-report","version":"1.0.0","private":true}' > package.json
npm install --ignore-scripts --no-audit --no-fund "plotly.js@$VERSION" "esbuild@$ESBUILD" >/dev/null
cat > entry.js <<'JS'
'use strict';
var Plotly = require('plotly.js/lib/core');
Plotly.register([require('plotly.js/lib/heatmap')]);
module.exports = Plotly;
JS
node_modules/.bin/esbuild entry.js --bundle --minify --format=iife --global-name=Plotly --target=es2016 \
  --define:global=window --define:define.amd=false --alias:stream=stream-browserify --legal-comments=none \
  --log-level=error --banner:js="/*! plotly.js v$VERSION (core: scatter; + heatmap), built by esbuild $ESBUILD. Copyright 2012-2026, Plotly, Inc. MIT license (plotly-LICENSE) */" \
  --outfile=out/plotly-report.min.js
cp out/plotly-report.min.js "$here/plotly-report.min.js"
cp node_modules/plotly.js/LICENSE "$here/plotly-LICENSE"
