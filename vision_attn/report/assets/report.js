// report.html's script, inlined in the page after the data it reads: ITEMS (one entry per explained
// image: its kind, patch grid, quantised maps, boxes or words) and PAGE (the filters' metadata and the
// confusion matrix). Each canvas keeps data-shown naming the map on display.
function decode(b64){
  const s=atob(b64);const a=new Uint8Array(s.length);
  for(let i=0;i<s.length;i++)a[i]=s.charCodeAt(i);
  return a;}
function jet(v){
  const f=x=>Math.min(1,Math.max(0,1.5-Math.abs(4*v-x)))*255;
  return `rgb(${f(3)|0},${f(2)|0},${f(1)|0})`;}
// The interactive view of one explained image: patches (click a patch), boxes (click a box), words (hover a word).
function View(item){
  const cv=document.getElementById('cv'+item.id),ctx=cv.getContext('2d'),img=new Image(),S=cv.width;
  const [gh,gw]=item.grid,N=gh*gw,data=item.maps?decode(item.maps):null,cw=S/gw,ch=S/gh;
  ctx.imageSmoothingEnabled=false;
  let mark=null;
  function paint(arr,off,label,extra){
    ctx.globalAlpha=1;ctx.drawImage(img,0,0,S,S);
    if(arr){let m=0;for(let i=0;i<N;i++)m=Math.max(m,arr[off+i]);ctx.globalAlpha=0.55;
      for(let i=0;i<N;i++){ctx.fillStyle=jet(m?arr[off+i]/m:0);
        ctx.fillRect((i%gw)*cw,Math.floor(i/gw)*ch,cw+0.5,ch+0.5);}}
    ctx.globalAlpha=1;if(extra)extra();cv.dataset.shown=label;}
  function drawBoxes(){ctx.lineWidth=2;item.boxes.forEach((b,k)=>{ctx.strokeStyle=k===mark?'#ff0':'#0f0';
    ctx.strokeRect(b[0]*S,b[1]*S,(b[2]-b[0])*S,(b[3]-b[1])*S);});
    ctx.setLineDash([5,3]);ctx.strokeStyle='#f33';(item.missed_boxes||[]).forEach(b=>
      ctx.strokeRect(b[0]*S,b[1]*S,(b[2]-b[0])*S,(b[3]-b[1])*S));ctx.setLineDash([]);}
  img.onload=()=>paint(null,0,'image',item.kind==='boxes'?drawBoxes:null);img.src=item.image;
  if(item.kind==='patches'){
    const H=item.heads,ls=document.getElementById('layer'+item.id),hs=document.getElementById('head'+item.id);
    const row=(l,h,p)=>((l*H+h)*N+p)*N;
    function show(p){const l=+ls.value,h=hs.value;mark=p;
      const outline=()=>{ctx.strokeStyle='#fff';ctx.lineWidth=2;ctx.strokeRect((p%gw)*cw,Math.floor(p/gw)*ch,cw,ch);};
      if(h==='fused'){const t=new Float32Array(N);for(let k=0;k<H;k++)for(let i=0;i<N;i++)t[i]+=data[row(l,k,p)+i]/H;
        paint(t,0,`layer${l}-fused-patch${p}`,outline);}
      else paint(data,row(l,+h,p),`layer${l}-head${h}-patch${p}`,outline);}
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();
      const x=Math.floor((e.clientX-r.left)/r.width*gw),y=Math.floor((e.clientY-r.top)/r.height*gh);
      show(Math.min(N-1,Math.max(0,y*gw+x)));});
    ls.onchange=hs.onchange=()=>{if(mark!==null)show(mark);};
  } else if(item.kind==='boxes'){
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();
      const fx=(e.clientX-r.left)/r.width,fy=(e.clientY-r.top)/r.height;
      let best=-1,area=1e9;item.boxes.forEach((b,k)=>{const a=(b[2]-b[0])*(b[3]-b[1]);
        if(fx>=b[0]&&fx<=b[2]&&fy>=b[1]&&fy<=b[3]&&a<area){best=k;area=a;}});
      if(best<0)return;mark=best;paint(data,best*N,`box${best}`,drawBoxes);
      document.getElementById('sel'+item.id).textContent=item.labels[best];});
  } else if(item.kind==='words'){
    const spans=document.querySelectorAll('#words'+item.id+' .word');
    spans.forEach(el=>{const k=+el.dataset.k;
      const on=()=>{spans.forEach(w=>w.classList.remove('on'));el.classList.add('on');paint(data,k*N,`word${k}`);};
      el.addEventListener('mouseenter',on);el.addEventListener('click',on);});
  }
}
// The grid's filters: correct / wrong, class, or one confusion-matrix cell (truth, predicted).
const F={cell:null,n:0};
const byId=id=>document.getElementById(id);
function applyFilters(){
  const ms=byId('f-mode'),cs=byId('f-class'),st=byId('f-status');
  const mode=ms?ms.value:'all',cls=cs&&cs.value!==''?PAGE.classes[+cs.value]:null;let shown=0;
  PAGE.meta.forEach((m,i)=>{let ok=true;
    if(F.cell)ok=m.truth===F.cell[0]&&m.pred===F.cell[1];
    else{if(mode==='correct')ok=m.correct===true;else if(mode==='wrong')ok=m.correct===false;
      if(ok&&cls!==null)ok=m.classes.includes(cls);}
    const el=byId('item'+i);if(el){el.hidden=!ok;if(ok)shown++;}});
  document.querySelectorAll('#confusion .cell').forEach(r=>r.classList.toggle('on',!!F.cell&&
    PAGE.labels[+r.dataset.t]===F.cell[0]&&PAGE.labels[+r.dataset.p]===F.cell[1]));
  if(st)st.textContent=F.cell
    ?`truth \u201c${F.cell[0]}\u201d, predicted \u201c${F.cell[1]}\u201d: ${F.n} images in the split, `+
      `${shown} of them explained below`
    :`showing ${shown} of ${PAGE.meta.length} explained images`;
  // a wrong cell: every one of its images, each with its map, in the evaluation's mistakes.html
  let link=byId('f-cell-link');
  if(!link&&st){link=document.createElement('a');link.id='f-cell-link';st.after(link);}
  if(link){const wrong=!!F.cell&&F.cell[0]!==F.cell[1];link.hidden=!wrong;
    link.textContent=wrong?` all ${F.n} with their maps: mistakes.html`:'';
    link.href=wrong?`mistakes.html#class=${encodeURIComponent(F.cell[0])}&confused=${encodeURIComponent(F.cell[1])}`:'#';}
  return shown;}
function resetFilters(){
  F.cell=null;const ms=byId('f-mode'),cs=byId('f-class');
  if(ms)ms.value='all';if(cs)cs.value='';applyFilters();}
for(const id of ['f-mode','f-class']){
  const el=byId(id);if(el)el.addEventListener('change',()=>{F.cell=null;applyFilters();});}
if(byId('f-clear'))byId('f-clear').addEventListener('click',resetFilters);
document.querySelectorAll('#confusion .cell').forEach(r=>r.addEventListener('click',()=>{
  const t=+r.dataset.t,p=+r.dataset.p;const ms=byId('f-mode'),cs=byId('f-class');
  if(ms)ms.value='all';if(cs)cs.value='';
  F.cell=[PAGE.labels[t],PAGE.labels[p]];F.n=PAGE.counts[t][p];applyFilters();byId('grid-top').scrollIntoView();}));
document.querySelectorAll('a.goto').forEach(a=>a.addEventListener('click',resetFilters));
// Mistake and section cards show the overlay of an explained image by copying its grid panel (one copy in the file).
document.querySelectorAll('img.copy').forEach(im=>{
  const s=document.querySelector('#item'+im.dataset.item+' .panels img');
  if(s)im.src=s.src;else im.remove();});
applyFilters();
window.addEventListener('load',()=>{for(const item of ITEMS)View(item);});
