// Extra webpack settings for build-labextension (package.json: jupyterlab.webpackConfig).
//
// Module ids from each module's path relative to this folder ('named') instead of
// production's default ('deterministic'): 'deterministic' hashes a module's full
// identifier, and the Module Federation container entry's identifier holds the
// absolute path of lib/index.js, so remoteEntry.*.js came out different in every
// checkout location.  'named' ids are the same wherever the build runs.
module.exports = {
  optimization: {
    moduleIds: 'named'
  }
};
